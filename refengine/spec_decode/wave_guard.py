"""Adaptive speculation's wave guard (pure Python): where closed batches whose span search chose to speculate
ran slower than plain decode would have, the next closed batches of that size and larger run plain decode
from their admission, re-tested at doubling intervals.

The span choice maximises a step's committed tokens a second. In a closed batch (a wave: its requests admitted
together into an idle engine, none joining until all have finished) that is not the batch's time: the batch
ends with its slowest request, and the tokens a speculating step commits for the others free slots nobody
waits for. The trained tiny pair's bench prompts are such a workload: some generations accept nearly every
draft and some nearly none (tests/unit/trained_pair_acceptance.json), so a c8 wave speculating on the good
ones' rates still waits for the poor ones' plain steps, paying each verify step (2-3 ms against a 0.5 ms plain
step on the H200). Where the policy had settled into plain decode beforehand (dormancy.py) it never looked;
after the bench's c1 cell, whose one request accepts nearly everything, the c8 cell speculated on c1's rates
and then probed every wave: 0.887 / 0.905 of plain (H200 runs 154 / 157; 0.857 replayed on the CPU,
tests/unit/trained_pair_replay.py). With the guard: 0.991 / 0.991 / 0.992 at c8 / c16 / c32 after c1 (run
161, controls 1.000 / 1.007 / 1.000), c1 2.85; the sharegpt profile at Qwen3-4B shapes, c32 1.054.

So each closed batch is judged at its end: the modelled time of every step the policy chose (its spans as
run, priced by the policy's own measured costs with the host's share: modelled_step_s), the steps after its
last choice as plain ones, against plain decode's time for the same tokens (each request's decode steps, the
batch shrinking as plain's would). Both sides use the same cost model and the acceptance that happened, so the
verdict is the choice's, not the clock's; it is still a model (at sharegpt's c32 it read 0.98-1.14 a wave
where the paired bench measured adaptive 5% faster: H200 run 161), hence a margin and a run of losses. Only
batches in which the span search itself chose to speculate are judged: probes and explorations alone have
their own budgets (exploration.py), and judged they held a fresh policy's learning waves plain and starved
dormancy of the evidence it settles on (tests/unit/test_rare_together.py). LOSSES_TO_HOLD judged batches in a
row that lost by more than GUARD_MARGIN hold the closed batches of the last one's size bucket and larger ones
(a speculating step's rows grow with the batch; its gains do not) for FIRST_HOLD batches: admitted retired
where the policy's own plain regime does not hold there (where it does, retirement and dormancy are at work),
as dormancy admits them (no taps, no drafter, plain decode's own steps). Then one runs awake as a re-test:
lost, the hold doubles (up to MAX_HOLD); not lost, the guard lets go. Batches shorter than MIN_JUDGED decode
steps are not judged (a 16-token warm-up is mostly its first-step probe), nor open ones (a request admitted
while others run: steady arrivals, a server's queue), where a request finishing early makes room for the next
one and tokens a second is the right measure; nor a wave split over several prefills (over max_prefill_tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from refengine.spec_decode.span_choice import RowsFn
from refengine.spec_decode.step_costs import CostModel

GUARD_MARGIN = 0.05  # a closed batch lost when its modelled time exceeds plain decode's by more than this share
FIRST_HOLD, MAX_HOLD = 4, 64  # closed batches of a size held plain after a loss; doubled per losing re-test
MIN_JUDGED = 32  # decode steps (its longest request's) a closed batch needs to be judged
LOSSES_TO_HOLD = 2  # judged closed batches lost in a row before a first hold (one wave's acceptance is a draw)
RATIOS_KEPT = 8


@dataclass
class _Batch:
    bucket: int  # the graph bucket of its size
    budgets: dict[int, int] = field(default_factory=dict)  # req -> max_tokens
    covered: dict[int, int] = field(default_factory=dict)  # req -> tokens its modelled steps account for
    generated: dict[int, int] = field(default_factory=dict)  # req -> tokens it ended with
    modelled_s: float = 0.0  # the steps chosen so far, priced
    choices: int = 0  # steps the span search chose to speculate (0: not judged)
    last_choice: frozenset[int] = frozenset()  # the requests of the last chosen step
    reused: int = 0  # plain steps reused since it (each commits one token a request)
    held: bool = False  # admitted retired by the guard
    prefill: tuple = ()  # the admitting prefill's key (its requests are one batch)


@dataclass
class WaveGuard:
    bucket_of: Callable[[int], int]  # batch size -> its graph bucket
    # the hold: closed batches of this bucket or larger ones are held (None: none), how many more, the next hold
    held_from: int | None = None
    held_left: int = 0
    next_hold: int = FIRST_HOLD
    judged: int = 0  # closed batches judged
    lost: int = 0  # of those, lost by more than GUARD_MARGIN
    held_batches: int = 0  # closed batches admitted retired by the guard
    ratios: list[float] = field(default_factory=list)  # the last RATIOS_KEPT judged batches' modelled / plain
    _losing: int = 0  # judged batches lost in a row
    _batch: _Batch | None = None  # the closed batch running, if any

    def admit(
        self, req_id: int, max_tokens: int, batch: int, arriving: int, prefill: tuple, unseen: Callable[[], bool]
    ) -> bool:
        """A new request (Retirement.admit's arguments; `prefill` tells its prefill's requests apart from the
        next one's): True when it is to be admitted retired (its batch's size is held, and `unseen()`: the
        policy's own plain regime does not hold there). A request joining running ones opens the batch: it is
        not judged."""
        b = self._batch
        if batch > arriving:  # others were running: an open batch
            self._batch = None
            return False
        if b is None or b.prefill != prefill:  # the first of a new closed batch
            b = self._batch = _Batch(self.bucket_of(batch), prefill=prefill)
            if self.held_from is not None and b.bucket >= self.held_from and self.held_left > 0:
                self.held_left -= 1
                b.held = unseen()
                self.held_batches += b.held
        b.budgets[req_id] = max_tokens
        b.covered[req_id] = 1  # the prefill's token
        return b.held

    @property
    def tracking(self) -> bool:
        """A closed batch is running (its steps are accounted)."""
        return self._batch is not None and not self._batch.held

    def step(self, req_ids: list[int], remaining: list[int], step_s: float, searched: bool) -> None:
        """A chosen step (its requests, their budgets left before it, its modelled time): each request's tokens
        before it are accounted for, and this step commits at least one more."""
        b = self._batch
        if b is None:
            return
        b.modelled_s += step_s
        b.choices += searched
        b.last_choice, b.reused = frozenset(req_ids), 0
        for r, left in zip(req_ids, remaining):
            if r in b.budgets:
                b.covered[r] = b.budgets[r] - left + 1

    def reuse(self, step_s: float) -> None:
        """The last chosen step's requests decode plainly again (AdaptivePolicy.reuse_plain), at `step_s`."""
        b = self._batch
        if b is not None:
            b.modelled_s += step_s
            b.reused += 1

    def release(self, req_id: int, generated: int | None, live: int, plain_s: Callable[[int], float]) -> None:
        """A request ended with `generated` tokens (None: its budget), `live` requests still running; at the
        batch's end it is judged (`plain_s`: a plain step's modelled time by batch size)."""
        b = self._batch
        if b is None or req_id not in b.budgets:
            return
        b.generated[req_id] = b.budgets[req_id] if generated is None else generated
        if live:
            return
        self._batch = None
        steps = {r: g - 1 for r, g in b.generated.items()}  # plain decode's steps after the prefill's token
        if b.held or not b.choices or max(steps.values()) < MIN_JUDGED:
            return
        # the plain steps after the last choice (and after the plain steps reused since it)
        done = {r: b.covered[r] + (b.reused if r in b.last_choice else 0) for r in b.generated}
        tail = {r: max(b.generated[r] - done[r], 0) for r in b.generated}
        ratio = (b.modelled_s + _plain_time(tail, plain_s)) / max(_plain_time(steps, plain_s), 1e-12)
        self.judged += 1
        self.ratios = (self.ratios + [ratio])[-RATIOS_KEPT:]
        if ratio > 1.0 + GUARD_MARGIN:  # larger batches lose more: a speculating step's rows grow with them
            self.lost += 1
            self._losing += 1
            held = self.held_from is not None
            if not held and self._losing < LOSSES_TO_HOLD:
                return
            self.held_from = b.bucket if self.held_from is None else min(self.held_from, b.bucket)
            self.held_left = self.next_hold if held else FIRST_HOLD
            self.next_hold = min(self.next_hold * 2, MAX_HOLD) if held else 2 * FIRST_HOLD
        else:
            self._losing = 0
            if self.held_from is not None and b.bucket >= self.held_from:  # a re-test that did not lose
                self.held_from, self.held_left, self.next_hold = None, 0, FIRST_HOLD

    @property
    def last_ratio(self) -> float | None:
        """The last judged batch's modelled time over plain decode's."""
        return self.ratios[-1] if self.ratios else None

    def summary(self) -> dict:
        return {
            "judged": self.judged,
            "lost": self.lost,
            "held_batches": self.held_batches,
            "held_from": self.held_from,  # closed batches of this bucket or larger held plain
            "held_left": self.held_left,
            "last_ratio": round(self.last_ratio, 4) if self.last_ratio is not None else None,
            "ratios": [round(r, 4) for r in self.ratios],
        }


def _plain_time(steps: dict[int, int], plain_s: Callable[[int], float]) -> float:
    """Plain decode's time for each request's steps, the batch shrinking as requests finish."""
    total, done, n = 0.0, 0, len(steps)
    for s in sorted(steps.values()):
        if s > done:
            total += (s - done) * plain_s(n)
            done = s
        n -= 1
    return total


def modelled_step_s(cost: CostModel, rows: RowsFn, spans: list[int], remaining: list[int], catch_up_rows: int) -> float:
    """A step's time by the policy's measured costs, the host's share included whether or not the choice prices
    it: plain decode's step where every span is 1, else the draft (with the catch-up of `catch_up_rows` carried
    context rows) and the verify of the spans, each cut to its request's budget as the scheduler cuts them."""
    n = len(spans)
    if max(spans) == 1:
        return plain_modelled_s(cost, n)
    spans = [min(s, max(r, 1)) for s, r in zip(spans, remaining)]
    drafted = sum(s > 1 for s in spans)
    draft = cost.draft_s(drafted, max(spans)) + cost.catch_up_s(catch_up_rows)
    return draft + cost.verify_s(n, rows(n, sum(spans))) + cost.host_fit_s("verify", n)


def plain_modelled_s(cost: CostModel, n: int) -> float:
    """A plain decode step of n requests by the policy's measured costs, the host's share included."""
    return cost.plain_s(n) + cost.host_fit_s("plain", n)
