"""Span policies for tests (refengine/span_policy/base.py's seam): ScriptedSpans runs a function of the step,
RandomSpans draws spans at random. Both record every report the scheduler hands them."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from refengine.span_policy import SpanPolicy, StepReport

Script = Callable[[int, Sequence[int], Sequence[int]], list[int]]  # (step, req_ids, remaining) -> spans


class ScriptedSpans(SpanPolicy):
    """`script(step, req_ids, remaining)` gives the spans (clipped to 1..min(B, remaining) here)."""

    name = "scripted"

    def __init__(self, block_size: int, script: Script):
        self.block, self.script, self.step = block_size, script, 0
        self.reports: list[StepReport] = []
        self.live: set[int] = set()

    def admit(self, req_id: int, budget: int) -> None:
        self.live.add(req_id)

    def choose(self, req_ids: Sequence[int], remaining: Sequence[int]) -> list[int]:
        spans = self.script(self.step, req_ids, remaining)
        self.step += 1
        return [max(1, min(s, self.block, r)) for s, r in zip(spans, remaining)]

    def observe(self, report: StepReport) -> None:
        self.reports.append(report)

    def release(self, req_id: int) -> None:
        self.live.discard(req_id)


def every_third_drafts(block: int) -> ScriptedSpans:
    """Two plain steps (every span 1), then a full block, over and over."""
    return ScriptedSpans(block, lambda step, ids, rem: [block if step % 3 == 2 else 1] * len(ids))


def random_spans(block: int, seed: int, plain_share: float = 0.25) -> ScriptedSpans:
    """Every step: all spans 1 with probability `plain_share`, else each request's span uniform in 1..B."""
    rng = random.Random(seed)

    def script(step: int, ids: Sequence[int], rem: Sequence[int]) -> list[int]:
        if rng.random() < plain_share:
            return [1] * len(ids)
        return [rng.randint(1, block) for _ in ids]

    return ScriptedSpans(block, script)
