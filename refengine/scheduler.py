"""Continuous batching: admission, and one plan per step (Prefill, Decode or Verify), then commit.

Eligible (speculating) and ineligible requests take turns in separate plans, so one never switches
speculation off for the other. Eligible requests the adaptive policy retired from speculation stay in the
eligible plans at span 1, uncaptured (spec_decode/probe_sample.py); a plan of retired requests only is plain
decode's own step. Every KV reservation of a step is made here, before the runner executes.

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
from collections.abc import Callable

from refengine.errors import AlignmentError, InvalidRequestError
from refengine.integrity import check_scheduler_integrity
from refengine.kv.pool import KvPool, blocks_for
from refengine.plan import DecodePlan, Plan, PrefillPlan, VerifyPlan
from refengine.request import FinishReason, RejectReason, Request, RequestStatus
from refengine.scheduler_commit import StepCommit
from refengine.spec_decode.acceptance_profile import AcceptanceOverride
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.cost_samples import CostSamples
from refengine.spec_decode.plain_stretch import PlainStretch
from refengine.spec_decode.proposer import DraftItem, Proposer
from refengine.spec_decode.shadow_probe import ShadowProbes
from refengine.validation import validate_prompt

log = logging.getLogger(__name__)


class Scheduler(StepCommit):
    def __init__(
        self,
        pool: KvPool,
        proposer: Proposer | None,
        *,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        max_context: int,
        max_num_seqs: int,
        max_prefill_tokens: int,
        speculation: str = "fixed",
        acceptance_override: AcceptanceOverride | None = None,
    ):
        """`speculation="adaptive"`: an AdaptivePolicy picks each verify span. `acceptance_override`:
        benchmark-only (refengine.bench passes it; EngineConfig cannot), replaces accept_greedy's m."""
        self.pool, self.proposer = pool, proposer
        self.vocab_size, self.eos_ids, self.max_context = vocab_size, set(eos_ids), max_context
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._verify_turn = True
        self._done: list[Request] = []
        self.policy = AdaptivePolicy(proposer.block_size) if speculation == "adaptive" and proposer else None
        if self.policy is not None:  # the rows a draft would catch up, as the proposer counts them (if it does)
            self.policy.pending = getattr(proposer, "pending_rows", None)
        self.acceptance_override = acceptance_override
        self.plan_counts: Counter = Counter()  # plan kind -> steps
        self.span_counts: Counter = Counter()  # verify span chosen (1 = a drafting request decoded plainly) -> steps
        self.costs = CostSamples(self.policy) if self.policy is not None else None  # its step-cost samples
        self._stretch: PlainStretch | None = None  # adaptive: the open plain stretch (spec_decode/plain_stretch.py)
        # adaptive: a batch whose every request is retired (the running list, its size); planned again without a
        # look while it holds, as retirement lasts until the request leaves (the list is rebuilt then)
        self._retired_batch: tuple[list[Request], int] | None = None
        # adaptive: requests retired from speculation -> their output length then; their span-1 steps since are
        # written into their SpecStats in one call when they leave (no per-request record a step)
        self.retired_at: dict[int, int] = {}  # (integrity.py checks it against the policy's)
        # adaptive: a plain choice's probes draft while the step decodes (spec_decode/shadow_probe.py), when
        # EngineConfig.shadow_probes (beside the decode graph on CUDA: runner/shadow_drafts.py)
        self.shadow_probes = False
        self.shadows = ShadowProbes()
        self._prepare_for: list[Request] | None = None  # a verify plan's requests: their next choice, prepared

    def bind_timings(
        self,
        timings: dict[str, float],
        rows: Callable[[int, int], int] | None = None,
        captures: Callable[[], int] | None = None,
        buckets: tuple[Callable[[int], int], Callable[[int], int]] | None = None,
        draft_caps: Callable[[int], int | None] | None = None,
    ) -> None:
        """The runner's cumulative GPU-synchronised timings (draft_s, verify_s): the adaptive policy's costs.
        `rows(n, real_rows)`: the rows a verify computes (graph shapes); `captures()`: graphs captured so far
        (a step that captured one is not a cost sample); `buckets`: the batch shapes a target step / a draft of n
        requests runs (the cost table's keys); `draft_caps(widest)`: the draft graph's score cap for a step whose
        largest span is `widest`, None for the full block's (graphs.py)."""
        if self.policy is not None and self.costs is not None:
            self.costs.bind(timings, captures)
            self.policy.bind_shapes(rows, buckets, draft_caps)

    # ---- admission ---------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request, or finish it at once as REJECTED with a message naming the limit and numbers.
        Its prompt (a list, tuple, 1-d array or tensor of integer ids) is validated and normalised here."""
        try:
            req.prompt_ids = validate_prompt(req.prompt_ids, self.vocab_size)
        except InvalidRequestError as e:
            req.reject(RejectReason.INVALID, str(e))
            return
        n, p = len(req.prompt_ids), req.params
        if n + p.max_tokens > self.max_context:
            req.reject(
                RejectReason.CONTEXT_LENGTH,
                f"prompt {n} + max_tokens {p.max_tokens} = {n + p.max_tokens} > max context {self.max_context} tokens",
            )
        elif blocks_for(n + p.max_tokens, self.pool.page_size) > self.pool.num_blocks:
            need = blocks_for(n + p.max_tokens, self.pool.page_size)
            req.reject(
                RejectReason.KV_BUDGET,
                f"prompt {n} + max_tokens {p.max_tokens} needs {need} KV blocks of "
                f"{self.pool.page_size} tokens; the pool holds {self.pool.num_blocks}",
            )
        else:
            self.waiting.append(req)

    @property
    def active_proposer(self) -> Proposer:
        """The proposer, for code that only runs for speculating requests (so there is one)."""
        if self.proposer is None:
            raise AlignmentError("a speculative path ran with no proposer loaded")
        return self.proposer

    def eligible(self, req: Request) -> bool:
        """Speculate only for greedy requests without logprobs, when a proposer is loaded."""
        return self.proposer is not None and req.params.logprobs == 0

    def speculates(self, req: Request) -> bool:
        """Eligible and not retired from speculation by the adaptive policy: it holds a drafter context, and
        its rows are captured. (A retired request still steps with the eligible ones, at span 1.)"""
        return self.eligible(req) and (self.policy is None or req.request_id not in self.policy.retired)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, req_id: int) -> Request | None:
        """The live (waiting or running) request with this id, or None."""
        return next((r for r in (*self.running, *self.waiting) if r.request_id == req_id), None)

    def _drop(self, req: Request, queues: bool = True) -> None:
        """Take a request out of the queues and free everything held for it (KV blocks, lifetime promise,
        drafter context, staged features). Idempotent; the caller sets its finish reason. `queues` False: the
        caller has taken it out of `running` itself (a step's finished requests at once: _retire_and_check)."""
        self.close_stretch()  # the batch changes: the stretch's steps go into its requests' stats first
        if queues:
            self.waiting = deque(r for r in self.waiting if r is not req)
            self.running = [r for r in self.running if r is not req]
        self.pool.release(req.request_id)
        self.shadows.release(req.request_id)
        retired_at = self.retired_at.pop(req.request_id, None)
        if retired_at is not None and len(req.output_ids) > retired_at:  # one token a step since it retired
            req.spec.record(1, 1, times=len(req.output_ids) - retired_at)
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        if self.policy is not None:
            self.policy.release(req.request_id, len(req.output_ids))
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
        self._prepare_for = None  # (a failed step's plan may have left it set)
        admitted: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            req = self.waiting[0]
            lifetime = len(req.prompt_ids) + req.params.max_tokens
            over_chunk = admitted and tokens + len(req.prompt_ids) > self.max_prefill_tokens
            if over_chunk or not self.pool.can_admit(lifetime):
                break  # FIFO: later requests wait behind the head
            self.waiting.popleft()
            self.pool.admit(req.request_id, lifetime)
            self.pool.extend(req.request_id, len(req.prompt_ids))
            req.status = RequestStatus.RUNNING
            admitted.append(req)
            tokens += len(req.prompt_ids)
        if admitted:
            if self.policy is not None:  # a dormant policy admits new requests retired (spec_decode/dormancy.py)
                batch = len(self.running) + len(admitted)
                for r in admitted:
                    rid = r.request_id
                    if self.eligible(r) and self.policy.admit(
                        rid, r.params.max_tokens, len(r.prompt_ids), batch, len(admitted)
                    ):
                        self.retired_at[rid] = 1  # its decode steps, from the one after its prefill's token
            plan = PrefillPlan(admitted, [self.speculates(r) for r in admitted])
            try:
                for r, c in zip(admitted, plan.capture):
                    if c:
                        self.active_proposer.start_request(r.request_id, len(r.prompt_ids) + r.params.max_tokens)
            except Exception as e:  # e.g. out of memory for a drafter context: a failed step like any other
                self.rollback(plan, e)
                return None
            self.plan_counts["prefill"] += 1
            return plan
        stretch, policy = self._stretch, self.policy
        if stretch is not None:
            if policy is not None and stretch.holds(self.running) and policy.reuse_plain(stretch.min_remaining):
                return self._decode(stretch.requests, capture=True)  # the same plain step again: no choice
            self.close_stretch()
        held = self._retired_batch
        if held is not None:  # a dormant wave's steps: asking each request cost 6 us a step at c32 (H200, run 132)
            if held[0] is self.running and len(self.running) == held[1]:
                return self._decode(self.running[:])  # plain decode's own step, as below
            self._retired_batch = None
        spec = [r for r in self.running if self.eligible(r)]
        plain = [r for r in self.running if not self.eligible(r)]
        if spec and (self._verify_turn or not plain):
            self._verify_turn = False
            uncaptured: frozenset[int] = frozenset()
            retired = self.policy.retired if self.policy is not None else set()
            if retired and all(r.request_id in retired for r in spec):
                if not plain:
                    self._retired_batch = (self.running, len(self.running))
                return self._decode(spec)  # every one retired from speculation: plain decode's own step
            remaining = [r.remaining for r in spec]
            if self.policy is not None:
                if self.costs is not None:
                    self.costs.choice_started()  # a speculating step's host time, from here (CostModel.host_s)
                spans = self._choose(spec, remaining)
                newly = self.policy.take_retired()
                if newly:
                    out_len = {r.request_id: len(r.output_ids) for r in spec}
                    for rid in newly:
                        self.active_proposer.release(rid)  # it drafts no more: its rows are not captured
                        self.retired_at[rid] = out_len[rid]
                if retired:
                    uncaptured = frozenset(r.request_id for r in spec if r.request_id in retired)
                if self.costs is not None:
                    self.costs.mark_plan()
                if self.shadow_probes:
                    probed = self.policy.shadowable(spans)
                    if probed:
                        return self._shadow_step(spec, spans, probed, uncaptured)
            else:
                spans = [self.active_proposer.block_size] * len(spec)
            if max(spans) > 1:  # (a plain choice, the common one in a plain stretch, skips this pass)
                spans = [min(s, left) for s, left in zip(spans, remaining)]  # never verify past the budget
            if self.policy is not None and max(spans) == 1:
                # plain decode for every speculating request: the decode step, with their tap-layer features
                # captured so the drafter context stays aligned (nothing to reserve, draft or accept)
                if len(uncaptured) == len(spec):  # the choice just retired the last of them
                    return self._decode(spec)
                if not plain and not uncaptured:  # every running request: a plain stretch (plain_stretch.py)
                    self._stretch = PlainStretch(spec, self.running, len(self.running), min(remaining))
                return self._decode(spec, capture=True, uncaptured=uncaptured)
            res = self.pool.schedule_speculative({r.request_id: s for r, s in zip(spec, spans)})
            self.plan_counts["verify"] += 1
            self._prepare_for = spec if self.policy is not None else None  # while it runs (while_waiting)
            return VerifyPlan(spec, spans, res, uncaptured)
        if plain:
            self._verify_turn = True
            return self._decode(plain)
        return None

    def while_waiting(self) -> None:
        """Host work that overlaps the step being run (the runner calls it between its graph's launch and its one
        host sync; Engine.step after the step, when no graph ran it): the cost samples go over, and during a
        speculating step the adaptive policy prepares the next choice for the requests that will still be
        running if none finishes (AdaptivePolicy.prepare). Once a step. If the preparation raises (a bug in the
        policy), it is logged and counted as a failed choice, and the next choice is made as usual."""
        if self.costs is not None:
            self.costs.feed()
        spec, self._prepare_for = self._prepare_for, None
        if spec is None:
            return
        assert self.policy is not None
        try:
            self.policy.prepare([r.request_id for r in spec], [r.remaining - 1 for r in spec])
        except Exception as e:
            self.policy.errors += 1
            self.policy.drop_prepared()
            log.warning("the adaptive policy's preparation failed (%s: %s)", type(e).__name__, e)
            log.debug("the failed preparation's traceback", exc_info=e)

    def _choose(self, spec: list[Request], remaining: list[int]) -> list[int]:
        """The policy's spans for the step; if its choice raises (a bug in it), plain decode for every request,
        logged and counted (AdaptivePolicy.errors, in its stats): spans never change a greedy output, so the
        engine keeps serving, where the exception, raised outside the step's transaction, used to stop it
        (twenty-third session: a retired request chosen to draft, docs/PERF.md). The bench fails on any."""
        assert self.policy is not None
        try:
            return self.policy.choose([r.request_id for r in spec], remaining)
        except Exception as e:
            self.policy.errors += 1
            self.policy.probed = []  # a failed choice's probes must not become this plain step's shadow probes
            log.warning("the adaptive policy's choice failed (%s: %s): this step decodes plainly", type(e).__name__, e)
            log.debug("the failed choice's traceback", exc_info=e)
            return [1] * len(spec)

    def _shadow_step(
        self, spec: list[Request], spans: list[int], probed: list[int], uncaptured: frozenset[int]
    ) -> DecodePlan:
        """A plain choice whose only drafting requests are probes: a decode step of every request, the probed
        ones drafting their block (span as chosen) at the same position (spec_decode/shadow_probe.py)."""
        items = tuple(
            DraftItem(spec[i].request_id, spec[i].output_ids[-1], spec[i].committed_len, spans[i]) for i in probed
        )
        assert self.policy is not None
        plan = self._decode(spec, capture=True, uncaptured=uncaptured, shadow=items)
        self.policy.shadows_launched([it.req_id for it in items])  # (once the plan exists: a rollback clears it)
        return plan

    def _decode(
        self,
        reqs: list[Request],
        capture: bool = False,
        uncaptured: frozenset[int] = frozenset(),
        shadow: tuple[DraftItem, ...] = (),
    ) -> DecodePlan:
        """A decode step of `reqs`: one KV row each (see DecodePlan for `capture`, `uncaptured`, `shadow`)."""
        for r in reqs:
            self.pool.extend(r.request_id, 1)
        self.plan_counts["shadow" if shadow else "decode"] += 1  # (their times: the runner's decode_s, shadow_s)
        return DecodePlan(reqs, capture=capture, uncaptured=uncaptured, shadow=shadow)

    # ---- failure: undo a plan (see the module docstring for the policy) -----------------------------------
    def take_done(self) -> list[Request]:
        """Requests finished by the steps since the last call (committed, or failed), in order."""
        done, self._done = self._done, []
        return done

    def check_integrity(self) -> None:
        """Scheduler, pool and proposer agree between steps (refengine/integrity.py lists what is checked)."""
        check_scheduler_integrity(self)
