"""Continuous batching: admission, one plan per step (Prefill, Decode or Verify), then commit.

Drafting requests (a proposer is loaded and the request is greedy without logprobs) and the others take turns
in separate plans, so one never switches speculation off for the other. For drafting requests the span policy
(refengine/span_policy/) chooses each request's verify span; spans all 1 make a decode step that records the
rows' tap features (their drafter context stays aligned), anything else a verify step where span-1 rows are
plain rows of the same forward. Every KV reservation of a step is made here, before the runner executes.

A step is a transaction (Engine.step). If executing a plan fails (the forward, the proposer, a malformed
result) or admission fails (a drafter context cannot be allocated), rollback() undoes every change the plan
made and the plan's requests are retried: admitted ones from the front of the waiting queue, running ones
with their KV back at their committed length. A request in MAX_FAILED_STEPS failed steps finishes with
FinishReason.ERROR and the exception in its message; requests outside the failed plan never notice. A
failure inside commit (validated first, so only a refengine bug) cannot be undone: abandon() finishes the
plan's unfinished requests with ERROR and frees what they hold, leaving every other request intact.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from refengine.errors import AlignmentError
from refengine.kv.pool import KvPool
from refengine.plan import DecodePlan, Plan, PrefillPlan, VerifyPlan
from refengine.request import FinishReason, Request
from refengine.scheduler.admission import Admission
from refengine.scheduler.commit import StepCommit
from refengine.scheduler.integrity import check_scheduler_integrity
from refengine.span_policy.base import SpanPolicy, StepReport
from refengine.spec_decode.acceptance_profile import AcceptanceOverride
from refengine.spec_decode.proposer import Proposer

log = logging.getLogger(__name__)


class Scheduler(Admission, StepCommit):
    def __init__(
        self,
        pool: KvPool,
        proposer: Proposer | None,
        policy: SpanPolicy | None,
        *,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        max_context: int,
        max_num_seqs: int,
        max_prefill_tokens: int,
        acceptance_override: AcceptanceOverride | None = None,
    ):
        """`policy` chooses the spans of drafting requests (required with a proposer). `acceptance_override`:
        benchmark-only (refengine.bench passes it; EngineConfig cannot), replaces accept_greedy's m."""
        if proposer is not None and policy is None:
            raise ValueError("a scheduler with a proposer needs a span policy")
        self.pool, self.proposer, self.policy = pool, proposer, policy
        self.vocab_size, self.eos_ids, self.max_context = vocab_size, set(eos_ids), max_context
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.acceptance_override = acceptance_override
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._verify_turn = True
        self._done: list[Request] = []
        self.plan_counts: Counter = Counter()  # plan kind -> steps
        self.span_counts: Counter = Counter()  # verify span chosen (1 = a drafting request decoded plainly) -> steps
        self.policy_errors = (
            0  # choices that raised or were malformed (those steps decoded plainly), observes that raised
        )
        self._step_report: StepReport | None = None
        self._head_keys: tuple[Request, list[bytes]] | None = None

    @property
    def active_proposer(self) -> Proposer:
        """The proposer, for code that only runs for drafting requests (so there is one)."""
        if self.proposer is None:
            raise AlignmentError("a speculative path ran with no proposer loaded")
        return self.proposer

    @property
    def active_policy(self) -> SpanPolicy:
        if self.policy is None:
            raise AlignmentError("a speculative path ran with no span policy")
        return self.policy

    def speculates(self, req: Request) -> bool:
        """A drafting request: a proposer is loaded and the request asks for no logprobs. It holds a
        drafter context from its prefill on, and every row it commits is recorded there. It is ready to draft
        once that context covers [0, committed): its prefill's rows plus those of the cached blocks it took
        (which carry tap features: scheduler/prefix.py), checked after every commit (_release_and_check)."""
        return self.proposer is not None and req.params.logprobs == 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, req_id: int) -> Request | None:
        """The live (waiting or running) request with this id, or None."""
        return next((r for r in (*self.running, *self.waiting) if r.request_id == req_id), None)

    def _drop(self, req: Request, queues: bool = True) -> None:
        """Take a request out of the queues and free everything held for it (KV blocks, lifetime promise,
        drafter context, staged features, the policy's record). Idempotent; the caller sets its finish reason.
        `queues` False: the caller has taken it out of `running` itself (a step's finished requests at once)."""
        if queues:
            self.waiting = deque(r for r in self.waiting if r is not req)
            self.running = [r for r in self.running if r is not req]
        self.pool.release(req.request_id)
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        if self.policy is not None:
            self.policy.release(req.request_id)
        if self.acceptance_override is not None:
            self.acceptance_override.release(req.request_id)

    def abort(self, req_id: int, message: str) -> Request | None:
        """Finish a live request at once with FinishReason.ABORTED, freeing what it holds; None if there is no
        live request with this id (unknown or already finished). Between steps only."""
        req = self.get(req_id)
        if req is None:
            return None
        self._drop(req)
        req.finish(FinishReason.ABORTED, message)
        return req

    # ---- planning ----------------------------------------------------------------------------------------
    def schedule(self) -> Plan | None:
        entries = self.admit_waiting()
        if entries:
            admitted = [r for r, _ in entries]
            plan = PrefillPlan(admitted, [self.speculates(r) for r in admitted], [c for _, c in entries])
            try:
                for r, drafts in zip(admitted, plan.capture):
                    if drafts:
                        self.active_proposer.start_request(r.request_id, len(r.prompt_ids) + r.params.max_tokens)
                        self.active_policy.admit(r.request_id, r.params.max_tokens)
            except Exception as e:  # e.g. out of memory for a drafter context: a failed step like any other
                self.rollback(plan, e)
                return None
            self.plan_counts["prefill"] += 1
            return plan
        spec: list[Request] = []
        plain: list[Request] = []
        for r in self.running:
            (spec if self.speculates(r) else plain).append(r)
        if spec and (self._verify_turn or not plain):
            self._verify_turn = False
            spans = self._choose(spec)
            if max(spans) == 1:  # plain decode for every drafting request, their rows' features recorded
                return self._decode(spec, capture=True)
            reservation = self.pool.schedule_speculative({r.request_id: s for r, s in zip(spec, spans)})
            self.plan_counts["verify"] += 1
            return VerifyPlan(spec, spans, reservation)
        if plain:
            self._verify_turn = True
            return self._decode(plain)
        return None

    def _choose(self, spec: list[Request]) -> list[int]:
        """The policy's spans, each within 1..min(B, remaining). A choice that raises or breaks those bounds
        is a bug in the policy: logged and counted (policy_errors), and the step decodes plainly (spans never
        change a greedy output, so the engine keeps serving)."""
        remaining = [r.remaining for r in spec]
        block = self.active_proposer.block_size
        try:
            spans = [int(s) for s in self.active_policy.choose([r.request_id for r in spec], remaining)]
            widest = max(spans, default=0)
            bad = len(spans) != len(spec) or min(spans, default=0) < 1 or widest > block
            if bad or (widest > 1 and any(s > left for s, left in zip(spans, remaining))):
                raise ValueError(f"spans {list(spans)[:8]} for budgets {remaining[:8]} (block {block})")
            return spans
        except Exception as e:
            self.policy_errors += 1
            log.warning("the span policy's choice failed (%s: %s): this step decodes plainly", type(e).__name__, e)
            log.debug("the failed choice's traceback", exc_info=e)
            return [1] * len(spec)

    def _decode(self, reqs: list[Request], capture: bool = False) -> DecodePlan:
        """A decode step of `reqs`: one KV row each (`capture`: drafting requests, their features recorded)."""
        for r in reqs:
            self.pool.extend(r.request_id, 1)
        self.plan_counts["decode"] += 1
        return DecodePlan(reqs, capture=capture)

    def take_done(self) -> list[Request]:
        """Requests finished by the steps since the last call (committed, or failed), in order."""
        done, self._done = self._done, []
        return done

    def check_integrity(self) -> None:
        """Scheduler, pool and proposer agree between steps (scheduler/integrity.py lists what is checked)."""
        check_scheduler_integrity(self)
