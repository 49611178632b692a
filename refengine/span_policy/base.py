"""The span-policy seam: what the scheduler asks a policy (each drafting request's verify span for a step) and
what it reports back (the step's spans, accepted drafts and measured time). The core (engine, scheduler,
runner, the DFlash lane) knows only this module; implementations are looked up by name (`build_span_policy`)
and imported on demand, so no core module imports one.

A span is how many tokens a request verifies this step: 1 is plain decode for that request (no draft; its
tap-layer features are still recorded, so its drafter context stays aligned and it may draft again later),
s > 1 drafts a block and verifies its first s tokens. Spans never change a greedy output, only its speed.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from refengine.errors import UnsupportedConfigError

# EngineConfig.speculation -> "module:class" (imported only when an engine asks for it)
SPAN_POLICIES = {
    "fixed": "refengine.span_policy.fixed:FixedSpans",
    "adaptive": "refengine.span_policy.goodput:GoodputSpans",
}


@dataclass(frozen=True)
class StepShapes:
    """How the runner shapes a step: the keys of a policy's cost table. Graphs run a step of n requests at
    the least batch bucket >= n and, for a verify, the least row cap c with bucket x c >= its rows plus one
    row per padding request; a draft scores the least cap >= its widest span. A kind without graphs (an
    empty tuple) runs at the step's own size: n requests, ceil(rows / n) rows each, its widest span."""

    batch_buckets: tuple[int, ...] = ()
    draft_buckets: tuple[int, ...] = ()
    verify_caps: tuple[int, ...] = ()
    draft_caps: tuple[int, ...] = ()

    def batch_bucket(self, n: int) -> int:
        return _least(self.batch_buckets, n)

    def draft_bucket(self, m: int) -> int:
        return _least(self.draft_buckets, m)

    def verify_cap(self, n: int, rows: int) -> int:
        bucket = self.batch_bucket(n)
        if not self.verify_caps or bucket not in self.batch_buckets:
            return -(-rows // n)
        need = rows + bucket - n
        return next((c for c in self.verify_caps if bucket * c >= need), self.verify_caps[-1])

    def draft_cap(self, widest: int) -> int:
        return _least(self.draft_caps, widest)


def _least(sizes: tuple[int, ...], n: int) -> int:
    """The least size >= n; n itself past the largest (that step runs eagerly) or with no sizes."""
    return next((s for s in sizes if s >= n), n)


EAGER_SHAPES = StepShapes()


@dataclass(frozen=True)
class ShapeCost:
    """One timed shape: kind "decode" (cap 1), "verify" or "draft", its batch bucket and cap, seconds."""

    kind: str
    bucket: int
    cap: int
    seconds: float


@dataclass(frozen=True)
class StepReport:
    """One committed step of drafting requests, as the scheduler reports it to the policy.
    spans[i]: the span request req_ids[i] verified (1: decoded plainly); accepted[i]: its drafts accepted
    (0..spans[i] - 1). seconds: the step's wall time, from its scheduling to the end of its commit (draft
    included, the catch-up of carried context excluded), draft_seconds: the draft's share; None when the step
    is no cost sample (it captured a graph). Reported after the commit: requests that finished are released."""

    req_ids: tuple[int, ...]
    spans: tuple[int, ...]
    accepted: tuple[int, ...]
    seconds: float | None
    draft_seconds: float | None


class SpanPolicy(ABC):
    """Chooses each drafting request's verify span per step. Four calls from the scheduler (admit, choose,
    observe, release); `start` and `stats` have defaults."""

    name: str = "policy"

    @abstractmethod
    def admit(self, req_id: int, budget: int) -> None:
        """A drafting request joined (budget: its max_tokens)."""

    @abstractmethod
    def choose(self, req_ids: Sequence[int], remaining: Sequence[int]) -> list[int]:
        """Spans for one step of these requests, each in 1..min(block, remaining[i])."""

    @abstractmethod
    def observe(self, report: StepReport) -> None:
        """The outcome of a step this policy chose."""

    @abstractmethod
    def release(self, req_id: int) -> None:
        """The request left (finished, aborted, or rolled back before it ran)."""

    def start(self, shapes: StepShapes, timed: Sequence[ShapeCost] = ()) -> None:
        """The runner's step shapes, and the captured graphs' timed replays when there are any."""
        return None

    def stats(self) -> dict:
        """JSON-ready statistics (Engine.span_stats()['detail'])."""
        return {}


def build_span_policy(name: str, block_size: int) -> SpanPolicy:
    """The policy EngineConfig.speculation names, for a proposer of `block_size`."""
    if name not in SPAN_POLICIES:
        raise UnsupportedConfigError(f"speculation={name!r}: use one of {tuple(SPAN_POLICIES)}")
    module, cls = SPAN_POLICIES[name].split(":")
    policy = getattr(importlib.import_module(module), cls)(block_size)
    if not isinstance(policy, SpanPolicy):
        raise UnsupportedConfigError(f"{SPAN_POLICIES[name]} is not a SpanPolicy")
    return policy
