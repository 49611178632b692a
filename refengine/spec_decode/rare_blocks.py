"""Adaptive speculation's rare blocks in large batches (a mixin of AdaptivePolicy, through Retirement:
refengine/spec_decode/retirement.py): where a probe step is dear beside a batch's whole work, blocks past the count
their kind reaches in under SURPRISE_ODDS of cases are judged together, and a lone one opens a doubt.

With nothing known to fail, a large batch's block is a surprise only past such a count (Retirement._surprising).
With every request of a c32 wave probed, a count reached in 3% of first blocks came once a wave, each a surprise
holding off the plain regime for a wave (the trained tiny pair on the H200, run 136): a step drafting k blocks
surprises once it has rare_in_many(k) of them (_rare_together). A lone one (a dormant policy's probe, an awake
c8 wave's sampled one) opens a doubt, settled by the blocks after it (_doubt): judged alone, it kept a c8 cell
awake ~25 waves (run 150). Where the probe is cheap (Qwen3-4B shapes) each block is judged alone: false alarms
cost little there and find turns sooner (tests/unit/test_rare_together.py, test_doubt.py).
"""

from __future__ import annotations

import functools

from refengine.spec_decode.dormancy import DORMANT_PRICE
from refengine.spec_decode.exploration import Exploration
from refengine.spec_decode.probe_sample import PROBE_SAMPLE

SURPRISE_ODDS = 0.05  # large batches, nothing known to fail: a block is a surprise past counts this rare
DOUBT_BLOCKS = 5  # a lone rare block's doubt (dear probes, large batches): it and the next 4 blocks settle it


@functools.lru_cache(maxsize=256)
def rare_in_many(k: int, odds: float = SURPRISE_ODDS) -> int:
    """The fewest c >= 1 such that c or more of k blocks, each past a count reached in `odds` of blocks, come in
    at most `odds` of steps: P(Binomial(k, odds) >= c) <= odds (1 for k <= 1: a lone block is judged alone)."""
    pmf, tail = (1.0 - odds) ** k, 1.0  # P(X = c - 1), P(X >= c) for c = 1
    for c in range(1, k + 1):  # (at c = k the tail is odds ** k: the loop always returns for k >= 1)
        tail -= pmf  # P(X >= c)
        if tail <= odds:
            return c
        pmf *= (k - c + 1) / c * odds / (1.0 - odds)
    return 1  # k = 0: no blocks to judge together


class RareBlocks(Exploration):
    """The probe step's price and a large batch's rare blocks; Retirement builds on it."""

    # what AdaptivePolicy provides, besides Exploration's
    _surprise_at: tuple[int, int, tuple[int, int] | None, bool]
    _judged: tuple[list[int], list[int], int, bool | None]
    _rare_seen: int
    rare_together: list[int]
    budgets: dict[int, int]
    _catch_up_rows: int

    def _probe_step_s(self, batch: int, plain: float, prompt_rows: int) -> float:
        """The predicted cost of a step of `batch` requests that probes one of them (its prompt's `prompt_rows`
        caught up) over a plain step's (`plain`: P(n) + H_plain(n), _find_plain_regime)."""
        span = min(self.estimates.failing_span(), self.block_size)  # a first-step probe's (exploration.py)
        probe = self.cost.draft_s(1, span) + self.cost.verify_s(batch, self.rows(batch, batch - 1 + span)) - plain
        return probe + self.cost.host_s("verify", batch) + self.cost.catch_up_s(prompt_rows)

    def _judge_together(self, req_ids: list[int], spans: list[int], remaining: list[int]) -> None:
        """The choice's step, whose observed blocks _rare_together judges: its requests, budgets left and drafting
        blocks (any kind: each is past its own kind's rare count in at most SURPRISE_ODDS of blocks, so the
        bound holds for the mix); whether its probe is dear is priced at its first rare block (most steps have
        none: no cost a step)."""
        self._judged = (req_ids, remaining, len(spans) - spans.count(1), None)
        self._rare_seen = 0

    def _rare_together(self, by_kind: tuple[bool, bool]) -> tuple[bool, bool]:
        """An observed block's verdicts (_surprising_by_kind's) with large batches' odds rule applied to blocks
        together where a probe step is dear beside the batch's whole work (the price rule's test, on the
        requests' budgets as admitted: a verdict that holds through a wave). A block past the rare count then
        surprises once its step has as many as k such blocks reach in under SURPRISE_ODDS of steps (rare_in_many,
        k the step's drafting blocks); a lone one (k = 1: a dormant policy's probe, an awake c8 wave's sampled
        one) opens a doubt instead, settled by the blocks after it (_doubt). With every request of a c32 wave
        probed, a count reached in 3% of first blocks came once a wave, each a surprise holding off the plain
        regime for a wave (H200 run 136). Where the probe is cheap each block is judged alone: false alarms cost
        little there and find turns sooner."""
        if self._surprise_at[2] is None:  # no odds rule: a failing position's rule, alone
            return by_kind
        rare, doubt = by_kind[1], self.dormancy.doubt
        req_ids, remaining, k, dear = self._judged
        if not (rare or doubt) or len(req_ids) < PROBE_SAMPLE:
            return by_kind
        self._rare_seen += rare
        if dear is None:  # priced once a step, at its first rare block (or first block in doubt)
            n, budgets = len(req_ids), self.budgets
            plain = self.cost.plain_step_s(n)
            work = sum(budgets.get(r, left) for r, left in zip(req_ids, remaining)) * plain / n
            dear = self._probe_step_s(n, plain, self._catch_up_rows // max(k, 1)) >= DORMANT_PRICE * work
            self._judged = (req_ids, remaining, k, dear)
        surprising = rare
        if dear and rare and k > 1:
            surprising = self._rare_seen >= rare_in_many(k)
            self.rare_together[0] += 1
            self.rare_together[1] += surprising
        elif dear and rare and doubt is None:
            self.dormancy.doubt = [0, 0]  # this block opens it (counted below)
            surprising = False
        if self.dormancy.doubt is not None:
            surprising = self._doubt(rare) or surprising
        return by_kind[0], surprising

    def _doubt(self, rare: bool) -> bool:
        """A block judged while a lone rare block's doubt is open (itself the first): True when the doubt's blocks
        hold as many past the rare count as that many blocks reach in under SURPRISE_ODDS (rare_in_many: the
        lone block and one more in its next DOUBT_BLOCKS - 1), a surprise; it closes then, or after DOUBT_BLOCKS
        with no surprise (a false alarm: dormancy resumes where it was). Judged alone, each lone rare block was a
        surprise: at the trained tiny pair's c8 on the H200 a dormant policy's probe past the rare count (1 in 20
        of them by the count's definition) kept the cell awake ~25 waves to rebuild DORMANT_AFTER calm blocks at
        one probe a wave (run 150: a process whose c8 cell ran 0.960 of plain, awake throughout)."""
        doubt = self.dormancy.doubt
        assert doubt is not None
        doubt[0] += 1
        doubt[1] += rare
        confirmed = doubt[1] >= rare_in_many(doubt[0])
        if doubt[0] == 1:  # the lone block itself opened it: judged by the blocks after it
            self.dormancy.doubts[0] += 1
            return False
        if confirmed:
            self.dormancy.doubts[1] += 1
        if confirmed or doubt[0] >= DOUBT_BLOCKS:
            self.dormancy.doubt = None
        return confirmed
