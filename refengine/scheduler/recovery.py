"""Undoing a failed step (the policy is in scheduler/scheduler.py's docstring): rollback() for a plan whose
execution failed, abandon() for a failure that cannot be undone. Mixed into the Scheduler."""

from __future__ import annotations

from collections import deque

from refengine.kv.pool import KvPool
from refengine.plan import DecodePlan, Plan, PrefillPlan
from refengine.request import FinishReason, Request, RequestStatus
from refengine.span_policy.base import SpanPolicy
from refengine.spec_decode.proposer import Proposer

MAX_FAILED_STEPS = 2  # a request in this many failed steps finishes with FinishReason.ERROR (1 retry)


class StepRecovery:
    # what the Scheduler provides
    pool: KvPool
    proposer: Proposer | None
    waiting: deque[Request]
    policy: SpanPolicy | None
    _step_report: object
    _done: list[Request]

    def speculates(self, req: Request) -> bool:
        raise NotImplementedError

    @property
    def active_proposer(self) -> Proposer:
        raise NotImplementedError

    def _drop(self, req: Request, queues: bool = True) -> None:
        raise NotImplementedError

    def rollback(self, plan: Plan, exc: BaseException, count: bool = True) -> None:
        """Undo every change `plan` made, so the state is as if it had never been scheduled: plain KV extends
        truncated, the speculative reservation reverted, staged features dropped, newly admitted requests
        released (KV and drafter context) and put back at the front of the waiting queue in order. With
        `count`, each request of the plan records a failed step; on its MAX_FAILED_STEPS-th, or when its KV
        or drafter context no longer match its committed tokens, it finishes with FinishReason.ERROR."""
        self._step_report = None
        if self.proposer is not None:
            self.proposer.discard_staged()
        if isinstance(plan, PrefillPlan):
            for r in plan.requests:
                self.pool.release(r.request_id)
                if self.proposer is not None:
                    self.proposer.release(r.request_id)
                if self.policy is not None:  # (admitted again on the retry)
                    self.policy.release(r.request_id)
                r.status = RequestStatus.WAITING
            self.waiting.extendleft(reversed(plan.requests))
        elif isinstance(plan, DecodePlan):
            for r in plan.requests:
                self.pool.truncate(r.request_id, r.committed_len)
        else:
            self.pool.revert_schedule(plan.reservation)  # nothing applied: frees every block it allocated
        if not count:
            return
        step = f"a {type(plan).__name__.removesuffix('Plan').lower()} step of {len(plan.requests)} requests"
        for r in plan.requests:
            r.failed_steps += 1
            broken = None if isinstance(plan, PrefillPlan) else self._mismatch(r)
            if r.failed_steps >= MAX_FAILED_STEPS or broken:
                self._drop(r)
                why = (
                    f"its state could not be rolled back ({broken})"
                    if broken
                    else f"{r.failed_steps} steps it was part of failed (at most {MAX_FAILED_STEPS - 1} is retried)"
                )
                r.finish(
                    FinishReason.ERROR,
                    f"request {r.request_id}: {why}; the last, {step}, raised {type(exc).__name__}: {exc}",
                )
                self._done.append(r)

    def _mismatch(self, req: Request) -> str | None:
        kv = self.pool.seq_len.get(req.request_id)
        if kv != req.committed_len:
            return f"KV length {kv} != committed {req.committed_len}"
        if self.speculates(req):
            try:
                rows = self.active_proposer.context_rows(req.request_id)
            except Exception as e:
                return f"drafter context unreadable: {type(e).__name__}: {e}"
            if rows != kv:
                return f"drafter context rows {rows} != committed KV length {kv}"
        return None

    def abandon(self, plan: Plan, exc: BaseException) -> None:
        """A failure that cannot be undone (inside commit, or in rollback itself: a refengine bug). Every
        request of the plan that has not finished finishes with FinishReason.ERROR and everything the plan's
        requests hold is freed; requests outside the plan are untouched."""
        self._step_report = None
        if self.proposer is not None:
            self.proposer.discard_staged()
        done = {id(r) for r in self._done}
        for r in plan.requests:
            self._drop(r)
            if not r.finished:
                r.finish(
                    FinishReason.ERROR,
                    f"request {r.request_id}: internal error in a step of "
                    f"{len(plan.requests)} requests (a refengine bug, not retried): "
                    f"{type(exc).__name__}: {exc}",
                )
            if id(r) not in done:
                self._done.append(r)
