"""What one engine step does (a Plan: exactly one of Prefill / Decode / Verify) and what it hands back.

The scheduler makes plans, the runner executes them, the scheduler commits the result. Plans and results
carry token ids and counts only: target hidden states stay between the runner and the proposer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from refengine.kv.pool import SpecReservation
from refengine.request import Request
from refengine.runner.logits import TopK


@dataclass
class PrefillPlan:
    requests: list[Request]
    capture: list[bool]          # capture drafter features for this request's prompt


@dataclass
class DecodePlan:
    requests: list[Request]


@dataclass
class VerifyPlan:
    requests: list[Request]
    spans: list[int]             # min(B, remaining budget): a request never verifies past its budget
    reservation: SpecReservation


Plan = PrefillPlan | DecodePlan | VerifyPlan


@dataclass
class StepResult:
    """What the runner hands back, per request of the plan, in plan order."""
    argmax: list[list[int]]                       # per scored row (the last prompt row for prefill, 1 for
                                                  # decode, every span row for verify)
    topk: list[list[TopK]] = field(default_factory=list)  # per scored row when the request asked for logprobs
    drafts: list[list[int]] = field(default_factory=list)  # verify: the span - 1 drafts each request proposed
