"""FixedSpans: every drafting request verifies a full block, min(B, remaining) (DFlash as upstream runs it)."""

from __future__ import annotations

from collections.abc import Sequence

from refengine.span_policy.base import SpanPolicy, StepReport


class FixedSpans(SpanPolicy):
    name = "fixed"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def admit(self, req_id: int, budget: int) -> None:
        pass

    def choose(self, req_ids: Sequence[int], remaining: Sequence[int]) -> list[int]:
        b = self.block_size
        return [b if r >= b else max(r, 1) for r in remaining]

    def observe(self, report: StepReport) -> None:
        pass

    def release(self, req_id: int) -> None:
        pass
