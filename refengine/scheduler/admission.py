"""Admission: a request is validated and checked against the engine's limits when it is added (rejected at
once, with a message naming the limit and the numbers, if it can never be served), and admitted FIFO into a
prefill while the batch, the prefill's token budget and the KV pool's lifetime promises allow; a prompt's
cached prefix (kv/prefix_cache.py, scheduler/prefix.py) counts as paid and is not prefilled."""

from __future__ import annotations

from collections import deque

from refengine.errors import InvalidRequestError
from refengine.kv.pool import KvPool, blocks_for
from refengine.request import RejectReason, Request, RequestStatus
from refengine.scheduler.prefix import PrefixSharing
from refengine.spec_decode.proposer import Proposer
from refengine.validation import validate_prompt


class Admission(PrefixSharing):
    # what the Scheduler provides
    pool: KvPool
    vocab_size: int
    max_context: int
    max_num_seqs: int
    max_prefill_tokens: int
    waiting: deque[Request]
    running: list[Request]

    @property
    def active_proposer(self) -> Proposer:
        raise NotImplementedError

    def add(self, req: Request) -> None:
        """Queue a request, or finish it at once as REJECTED with a message naming the limit and numbers.
        Its prompt (a list, tuple, 1-d array or tensor of integer ids) is validated and normalised here."""
        try:
            req.prompt_ids = validate_prompt(req.prompt_ids, self.vocab_size)
        except InvalidRequestError as e:
            req.reject(RejectReason.INVALID, str(e))
            return
        n, p = len(req.prompt_ids), req.params
        need = blocks_for(n + p.max_tokens, self.pool.page_size)
        if n + p.max_tokens > self.max_context:
            req.reject(
                RejectReason.CONTEXT_LENGTH,
                f"prompt {n} + max_tokens {p.max_tokens} = {n + p.max_tokens} > max context {self.max_context} tokens",
            )
        elif need > self.pool.num_blocks:
            req.reject(
                RejectReason.KV_BUDGET,
                f"prompt {n} + max_tokens {p.max_tokens} needs {need} KV blocks of "
                f"{self.pool.page_size} tokens; the pool holds {self.pool.num_blocks}",
            )
        else:
            self.waiting.append(req)

    def admit_waiting(self) -> list[tuple[Request, int]]:
        """Take waiting requests, in order, into one prefill: while the batch has room, the prefill's tokens
        stay within max_prefill_tokens (its first request always fits) and the pool can promise each its
        lifetime blocks. A request that does not fit stops admission: later ones wait behind it. Returns each
        admitted request with the prompt tokens it took from the prefix cache (prefilled: the rest)."""
        admitted: list[tuple[Request, int]] = []
        drafting: list[int] = []  # capacities of the drafting requests admitted so far
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            req = self.waiting[0]
            lifetime = len(req.prompt_ids) + req.params.max_tokens
            keys, hit = self._lookup(req)
            cached = len(hit) * self.pool.page_size
            if admitted and tokens + len(req.prompt_ids) - cached > self.max_prefill_tokens:
                break
            if not self.pool.can_admit(lifetime, hit):
                break
            # a drafter context is per request: shared target blocks leave the lane's pool (sized like the
            # target's) short of pages only with a prefix cache, so only then is it asked
            drafts = self.speculates(req)
            if drafts and self.pool.prefix_cache is not None:
                if not self.active_proposer.can_start([*drafting, lifetime]):
                    break
            if drafts:
                drafting.append(lifetime)
            self.waiting.popleft()
            self.pool.admit(req.request_id, lifetime, hit, keys)
            self.pool.extend(req.request_id, len(req.prompt_ids) - cached)
            req.status, req.cached_tokens = RequestStatus.RUNNING, cached
            admitted.append((req, cached))
            tokens += len(req.prompt_ids) - cached
        return admitted
