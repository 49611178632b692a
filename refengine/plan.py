"""What one engine step does (a Plan: exactly one of Prefill / Decode / Verify) and what it hands back.

The scheduler makes plans, the runner executes them, the scheduler commits the result. Plans and results
carry token ids and counts only: target hidden states stay between the runner and the proposer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refengine.kv.pool import SpecReservation
from refengine.request import Request

TopK = tuple[list[int], list[float]]  # (ids, logprobs) of one position, best first


@dataclass
class PrefillPlan:
    requests: list[Request]
    capture: list[bool]  # capture drafter features for this request's prompt
    # prompt tokens each request took from the prefix cache (whole blocks; empty: none): only the rest run
    cached: list[int] = field(default_factory=list)

    def cached_tokens(self, i: int) -> int:
        return self.cached[i] if self.cached else 0


@dataclass
class DecodePlan:
    requests: list[Request]
    # the requests are drafting ones whose spans are all 1: record every row's tap features (their drafter
    # context stays aligned). False: requests that do not draft (logprobs, or no proposer).
    capture: bool = False


@dataclass
class VerifyPlan:
    requests: list[Request]  # drafting requests, every row's features recorded
    spans: list[int]  # 1..min(B, remaining budget): a request never verifies past its budget; 1 = a plain row
    reservation: SpecReservation


Plan = PrefillPlan | DecodePlan | VerifyPlan
PLAN_KINDS = ("prefill", "decode", "decode_taps", "verify")


def plan_kind(plan: Plan) -> str:
    """The step's kind for timings (refengine bench): a decode step of drafting requests, which records their
    tap features (`decode_taps`), is told apart from a decode step of requests that do not draft (`decode`)."""
    if isinstance(plan, PrefillPlan):
        return "prefill"
    if isinstance(plan, DecodePlan):
        return "decode_taps" if plan.capture else "decode"
    return "verify"


@dataclass
class StepResult:
    """What the runner hands back, per request of the plan, in plan order."""

    argmax: list[list[int]]  # per scored row (the last prompt row for prefill, 1 for
    # decode, every span row for verify)
    topk: list[list[TopK]] = field(default_factory=list)  # per scored row when the request asked for logprobs
    drafts: list[list[int]] = field(default_factory=list)  # verify: the span - 1 drafts each request proposed
    seconds: float | None = None  # the step's wall time, when it is a cost sample (no graph was captured in it)
    draft_seconds: float | None = None  # a verify step's draft share of `seconds`, catch-up projection excluded


def scored_rows(plan: Plan, i: int) -> int:
    """How many rows of request i of `plan` the runner scores: every prompt row (prompt_logprobs) or the
    last, one for decode, the whole span for verify."""
    req = plan.requests[i]
    if isinstance(plan, PrefillPlan):
        return len(req.prompt_ids) if req.params.prompt_logprobs else 1
    return 1 if isinstance(plan, DecodePlan) else plan.spans[i]


def validate_result(plan: Plan, result: StepResult, vocab_size: int, staged: set[int]) -> None:
    """Check a result against its plan before commit mutates anything (StepError naming the request and the
    numbers): one argmax row per scored row, top-k rows for requests with logprobs, span - 1 drafts per
    verify request, ids inside the vocabulary, staged features for every request that captures them."""
    from refengine.errors import StepError

    n = len(plan.requests)
    if len(result.argmax) != n:
        raise StepError(f"result has argmax for {len(result.argmax)} requests, the plan has {n}")
    wants_topk = any(r.params.logprobs for r in plan.requests)
    if wants_topk and len(result.topk) != n:
        raise StepError(f"result has top-k for {len(result.topk)} requests, the plan has {n}")
    if isinstance(plan, VerifyPlan) and len(result.drafts) != n:
        raise StepError(f"result has drafts for {len(result.drafts)} requests, the verify plan has {n}")
    every_row_captures = isinstance(plan, VerifyPlan) or (isinstance(plan, DecodePlan) and plan.capture)
    for i, req in enumerate(plan.requests):
        rows, rid = scored_rows(plan, i), req.request_id
        if len(result.argmax[i]) != rows:
            raise StepError(f"request {rid}: {len(result.argmax[i])} argmax rows, {rows} expected")
        if wants_topk and req.params.logprobs and len(result.topk[i]) != rows:
            raise StepError(f"request {rid}: {len(result.topk[i])} top-k rows, {rows} expected")
        ids = list(result.argmax[i])
        if isinstance(plan, VerifyPlan):
            if len(result.drafts[i]) != rows - 1:
                raise StepError(f"request {rid}: {len(result.drafts[i])} drafts for a span of {rows}")
            ids += result.drafts[i]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise StepError(f"request {rid}: token ids {bad[:4]} outside the vocabulary 0..{vocab_size - 1}")
        captures = plan.capture[i] if isinstance(plan, PrefillPlan) else every_row_captures
        if captures and rid not in staged:
            raise StepError(f"request {rid}: no drafter features were staged for its {rows}-row step")
