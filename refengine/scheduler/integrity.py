"""The between-steps integrity check: scheduler, KV pool and proposer agree about what is live."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from refengine.errors import IntegrityError
from refengine.kv.pool import KvPool, blocks_for
from refengine.request import Request, RequestStatus
from refengine.spec_decode.proposer import Proposer


class SchedulerState(Protocol):
    """What the check reads of the Scheduler."""

    pool: KvPool
    proposer: Proposer | None
    running: list[Request]

    @property
    def waiting(self) -> Sequence[Request]: ...

    def speculates(self, req: Request) -> bool: ...


def check_scheduler_integrity(sched: SchedulerState) -> None:
    """Scheduler, pool and proposer agree (between steps): each live request is queued once with the
    matching status; every running request has a table covering exactly its committed length; nothing
    (blocks, lifetime promise, drafter context, staged features) is held for a request that is not
    running, waiting ones included; the proposer holds exactly the drafting requests, and each one's drafter
    context matches its KV; with a prefix cache (reference counts and the cache's blocks: KvPool.check_integrity)
    no drafting request holds a cached block flagged without tap features."""
    sched.pool.check_integrity()
    running = {r.request_id: r for r in sched.running}
    waiting = {r.request_id: r for r in sched.waiting}
    if len(running) != len(sched.running) or len(waiting) != len(sched.waiting) or running.keys() & waiting:
        raise IntegrityError(
            f"a request is queued twice: running {[r.request_id for r in sched.running]}, "
            f"waiting {[r.request_id for r in sched.waiting]}"
        )
    for rid, req in (*running.items(), *waiting.items()):
        want = RequestStatus.RUNNING if rid in running else RequestStatus.WAITING
        if req.status is not want:
            raise IntegrityError(f"request {rid} is {req.status.value} but queued as {want.value}")
    orphans = sorted(set(sched.pool.live_requests()) - set(running))
    if orphans:
        raise IntegrityError(f"KV pool holds requests {orphans} that are not running")
    for rid, req in running.items():
        kv = sched.pool.seq_len.get(rid)
        if kv != req.committed_len:
            raise IntegrityError(f"request {rid}: KV length {kv} != committed {req.committed_len}")
        need = blocks_for(kv, sched.pool.page_size)
        if len(sched.pool.table(rid)) != need:
            raise IntegrityError(
                f"request {rid}: {len(sched.pool.table(rid))} blocks for {kv} tokens "
                f"(exactly {need} expected between steps)"
            )
    if sched.proposer is not None:
        spec = {rid for rid, r in running.items() if sched.speculates(r)}
        staged = sched.proposer.staged_requests()
        if staged:
            raise IntegrityError(f"proposer holds staged features for requests {sorted(staged)} between steps")
        live = sched.proposer.live_requests()
        if live != spec:
            raise IntegrityError(f"proposer holds requests {sorted(live)}, speculating requests are {sorted(spec)}")
        cache = sched.pool.prefix_cache
        for rid in spec:
            featureless = [b for b in sched.pool.table(rid) if cache is not None and cache.lacks_features(b)]
            if featureless:
                raise IntegrityError(
                    f"request {rid} drafts from cached blocks {featureless[:8]} whose tap features are not in the store"
                )
            rows = sched.proposer.context_rows(rid)
            if rows != sched.pool.seq_len[rid]:
                raise IntegrityError(
                    f"request {rid}: drafter context rows {rows} != committed KV {sched.pool.seq_len[rid]}"
                )
