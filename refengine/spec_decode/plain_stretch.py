"""Adaptive mode's plain stretches: consecutive steps in which every running request decodes plainly (span 1)
under one reused plain decision of the policy, for one unchanged batch.

The scheduler plans such a step from the stretch, without rebuilding its per-request lists or asking the policy
for spans (AdaptivePolicy.reuse_plain answers at O(1)), and counts the step here instead of recording it in
every request's SpecStats. The counted steps (one token, span 1 each) are written into the requests' stats when
the stretch closes: before any other plan is made for them, and before one of them leaves the batch
(Scheduler._drop), so a finished request's stats are complete and in order. A running request's stats lag by
the open stretch until then (Scheduler.close_stretch writes them). The steps of a stretch, all of one shape,
give the policy one cost sample in STRETCH_SAMPLE (their mean; CostSamples.take), the last ones at the close.

Why: on the H200's host (Qwen3-4B shapes, c32, docs/PERF.md run 51) adaptive's plain steps took 141 us more host
time a step than plain decode's, ~4.4 us a request, of which the per-request lists and the choice were ~40 us and
the per-request stats records ~25 us.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.request import Request

STRETCH_SAMPLE = 8  # a stretch's steps (one shape) give the policy a cost sample once in this many, their mean


@dataclass
class PlainStretch:
    requests: list[Request]  # the plans' requests (every running request: none of them ineligible)
    running: list[Request]  # the scheduler's running list at the opening (the batch: this same list, same length)
    size: int
    min_remaining: int  # the smallest token budget left among them, as of the next plan
    steps: int = 0  # committed steps not yet written into the requests' SpecStats

    def holds(self, running: list[Request]) -> bool:
        """The batch is unchanged: nothing admitted (the list grew) or dropped (the scheduler rebuilt it)."""
        return running is self.running and len(running) == self.size

    def count_step(self) -> None:
        """A committed plain step of the stretch: one token for each request."""
        self.steps += 1
        self.min_remaining -= 1

    def close(self) -> None:
        """Write the counted steps into each request's SpecStats (one token committed, span 1, a step)."""
        if self.steps:
            for r in self.requests:
                r.spec.record(1, 1, times=self.steps)
            self.steps = 0
