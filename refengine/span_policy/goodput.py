"""GoodputSpans (speculation="adaptive"): per step, the spans that maximise expected goodput, from measured
step costs (step_costs.py) and per-request acceptance (acceptance.py); docs/PORTING.md states the rule as math.
A candidate is a cap S (2, 4, ..., B) and the k requests drafting at it (span min(S, r_i); the rest span 1),
priced C = D(k, S) + V(N, rows) against a plain step's P(N). An open batch maximises tokens a second, sum_i
E_i(s_i) / C; a closed one (admitted together, nobody joining) lasts as long as its slowest request, so it
minimises C x max_i r_i / E_i(s_i). Speculation must beat plain by SPEC_MARGIN; exploration searches optimistic
estimates (acceptance one deviation up, each step at its graph replay's floor) within EXPLORE_BUDGET of
predicted regret, each exploration charged what its step costs (_exploration_cost) and never held; a decision
the search repeats is held 1, 2, 4, ... HOLD_MAX steps (for an unchanged batch, or a uniform one, every span
min(S, r_i), for any batch of its size).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from refengine.span_policy.acceptance import POPULATION_DECAY, AcceptanceEstimates
from refengine.span_policy.base import EAGER_SHAPES, ShapeCost, SpanPolicy, StepReport, StepShapes
from refengine.span_policy.step_costs import StepCosts

SPEC_MARGIN = 0.05  # least predicted gain over plain to speculate: a wrong spec step loses more than a plain one
EXPLORE_BUDGET = 0.02  # exploration may cost at most this share of the time run (predicted regret)
OPTIMISM = 1.0  # exploration's estimates: this many posterior standard deviations above the mean
HOLD_MAX = 16  # most steps a repeated decision for one batch is held between searches


@dataclass(frozen=True)
class Choice:
    spans: list[int]
    rate: float  # the objective (tokens a second, or the inverse drain time)
    cost: float  # the step's predicted seconds


class GoodputSpans(SpanPolicy):
    name = "adaptive"

    def __init__(self, block_size: int):
        self.block = block_size
        self.caps = np.array(sorted({min(1 << i, block_size) for i in range(1, max(block_size, 2).bit_length())}))
        self.estimates = AcceptanceEstimates(max(block_size, 2))
        self.costs = StepCosts()
        self.shapes = EAGER_SHAPES
        self.live: set[int] = set()  # admitted, not released
        self.open = False  # a request joined the batch after a step of it was chosen
        self._chosen = False  # a step was chosen since the batch last emptied
        self.elapsed_s = 0.0  # observed step time, fading by POPULATION_DECAY a step
        self.regret_s = 0.0  # predicted cost of the explorations taken, fading likewise
        self.counts: Counter = Counter()  # decisions searched (plain, spec; explored among them), timing, held
        self._draft_buckets: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> draft buckets of k = 1..n
        # the last searched decision: (what it holds for, its spans, steps it is still held, its hold interval);
        # a uniform one (every span min(S, r_i), plain included) holds for any batch of its size, spans as S
        self._hold: tuple[object, list[int], int, int] | None = None
        self._timed: set[int] = set()  # batch sizes whose plain and full-span steps are priced

    def start(self, shapes: StepShapes, timed: Sequence[ShapeCost] = ()) -> None:
        self.shapes, self._draft_buckets, self._timed = shapes, {}, set()
        for c in timed:
            self.costs.seed(c.kind, c.bucket, c.cap, c.seconds)

    def admit(self, req_id: int, budget: int) -> None:
        if self.live and self._chosen:
            self.open = True
        self.live.add(req_id)
        self.estimates.add(req_id)

    def release(self, req_id: int) -> None:
        self.live.discard(req_id)
        self.estimates.remove(req_id)
        if not self.live:
            self.open = self._chosen = False

    def choose(self, req_ids: Sequence[int], remaining: Sequence[int]) -> list[int]:
        self._chosen = True
        self.estimates.advance()
        n = len(req_ids)
        hold = self._hold
        if hold is not None and hold[2] > 0 and hold[0] in (n, req_ids):
            self._hold = (hold[0], hold[1], hold[2] - 1, hold[3])
            self.counts["held"] += 1
            spans = hold[1] if hold[0] == req_ids else hold[1][:1] * n
            return [min(s, left) if left > 1 else 1 for s, left in zip(spans, remaining)]
        r = np.minimum(np.asarray(remaining, dtype=np.int64), self.block)
        if self.block < 2 or n == 0 or r.max() < 2:
            return [1] * n
        untimed = None if n in self._timed else self._untimed(r)
        if untimed is not None:
            self.counts["timing"] += 1
            return [int(x) for x in r] if untimed else [1] * n
        explore = self.regret_s < EXPLORE_BUDGET * self.elapsed_s
        tables = self.estimates.tables(req_ids, OPTIMISM) if explore else self.estimates.tables(req_ids)[None]
        best = self._search(tables[0], r)
        opt = self._search(tables[1], r, floor=True) if explore and best.spans != r.tolist() else best  # (all full)
        explored = False
        if opt.spans != best.spans:
            opt_spans = np.asarray(opt.spans)
            cost = self._exploration_cost(opt_spans, opt.cost)
            rate = self._rate(tables[0][np.arange(n), opt_spans - 1], r, cost)
            regret = cost * max(0.0, 1.0 - rate / best.rate)
            if self.regret_s + regret <= EXPLORE_BUDGET * (self.elapsed_s + cost):
                self.regret_s += regret
                self.counts["explored"] += 1
                best, explored = opt, True
        self.counts["spec" if max(best.spans) > 1 else "plain"] += 1
        if explored:  # one step, charged as one: an exploration is never held
            self._hold = None
            return best.spans
        cap = max(best.spans)
        uniform = all(s == min(cap, x) for s, x in zip(best.spans, r.tolist()))
        key, spans = (n, [cap]) if uniform else (list(req_ids), best.spans)
        again = hold is not None and hold[0] == key and hold[1] == spans
        interval = min(2 * hold[3], HOLD_MAX) if again and hold is not None else 1
        self._hold = (key, spans, interval - 1, interval)
        return best.spans

    def observe(self, report: StepReport) -> None:
        widest = max(report.spans)
        if widest > 1:
            self.estimates.observe(report.req_ids, report.spans, report.accepted)
        if report.seconds is None:
            return
        sh, n = self.shapes, len(report.spans)
        if widest == 1:
            self.costs.observe("decode", sh.batch_bucket(n), 1, report.seconds)
        else:
            draft = report.draft_seconds or 0.0
            k, rows = sum(s > 1 for s in report.spans), sum(report.spans)
            self.costs.observe("draft", sh.draft_bucket(k), sh.draft_cap(widest), draft)
            self.costs.observe("verify", sh.batch_bucket(n), sh.verify_cap(n, rows), report.seconds - draft)
        # the budget is a share of the recent time (the population's memory), not a bank that grows for ever
        self.elapsed_s = self.elapsed_s * POPULATION_DECAY + report.seconds
        self.regret_s *= POPULATION_DECAY

    def stats(self) -> dict:
        rates = [round(float(a), 3) for a in self.estimates.rates()]
        times = {"elapsed_s": round(self.elapsed_s, 4), "regret_s": round(self.regret_s, 4)}
        return {"decisions": dict(self.counts), **times, "acceptance_by_position": rates}

    def _cost(self, spans: np.ndarray, floor: bool = False) -> float | None:
        """The predicted seconds of a step with these spans (all 1: a plain step); `floor`: StepCosts.get's."""
        sh, n = self.shapes, len(spans)
        if spans.max() == 1:
            return self.costs.get("decode", sh.batch_bucket(n), 1, floor)
        k, widest = int((spans > 1).sum()), int(spans.max())
        draft = self.costs.get("draft", sh.draft_bucket(k), sh.draft_cap(widest), floor)
        verify = self.costs.get("verify", sh.batch_bucket(n), sh.verify_cap(n, int(spans.sum())), floor)
        return None if draft is None or verify is None else draft + verify

    def _exploration_cost(self, spans: np.ndarray, floor: float) -> float:
        """What an exploration with these spans (their replays' floor `floor`) is charged: its predicted cost, but
        no more than its floor scaled as this batch's plain steps run above theirs. Replays leave the host out (a
        host-bound pair's steps cost ten times theirs), and one slow sample must not price a kind out for ever."""
        plain = np.ones(len(spans), dtype=np.int64)
        predicted, plain_cost, plain_floor = self._cost(spans), self._cost(plain), self._cost(plain, floor=True)
        assert predicted is not None and plain_cost is not None and plain_floor  # (priced: _untimed)
        return min(predicted, floor * plain_cost / plain_floor)

    def _untimed(self, r: np.ndarray) -> bool | None:
        """True: no speculating step is priced yet (time one); False: no plain step is; None: both are."""
        if self._cost(r) is None:
            return True
        if self._cost(np.ones_like(r)) is None:
            return False
        self._timed.add(len(r))  # (a kind once priced prices every shape: StepCosts.get's line)
        return None

    def _cost_grid(self, n: int, widest: np.ndarray, rows: np.ndarray, floor: bool = False) -> np.ndarray:
        """C(k, S) for k = 1..n drafting at caps S, [..., C, n]: `widest` [C] each cap's widest span, `rows`
        [..., C, n] the step's rows. Each distinct shape is priced once (graphs: a few buckets and caps)."""
        sh, get = self.shapes, partial(self.costs.get, floor=floor)
        if n not in self._draft_buckets:
            self._draft_buckets[n] = np.unique([sh.draft_bucket(k) for k in range(1, n + 1)], return_inverse=True)
        buckets, index = self._draft_buckets[n]
        draft = np.array([[get("draft", int(b), c) for b in buckets] for c in map(sh.draft_cap, widest.tolist())])
        bucket = sh.batch_bucket(n)
        if sh.verify_caps and bucket in sh.batch_buckets:
            caps = np.asarray(sh.verify_caps)
            at = np.minimum(np.searchsorted(bucket * caps, rows + bucket - n), len(caps) - 1)
            verify = np.array([get("verify", bucket, int(c)) for c in caps], dtype=float)[at]
        else:  # eager: ceil(rows / n) rows a request
            per = -(-rows // n)
            uniq, inv = np.unique(per, return_inverse=True)
            verify = np.array([get("verify", bucket, int(c)) for c in uniq], dtype=float)[inv].reshape(rows.shape)
        return draft[:, index] + verify

    def _rate(self, e: np.ndarray, r: np.ndarray, cost: float) -> float:
        return float(e.sum() / cost) if self.open else float(1.0 / (np.max(r / e) * cost))

    def _search(self, table: np.ndarray, r: np.ndarray, floor: bool = False) -> Choice:
        """The best choice for the estimate `table` [N, B], every cap and prefix priced at once (`floor`: each
        shape at its least cost, StepCosts.get's)."""
        n = len(r)
        plain_cost = self._cost(np.ones(n, dtype=np.int64), floor)
        assert plain_cost is not None
        s = np.minimum(r[None, :], self.caps[:, None])  # [C, N]: spans at each cap
        e = table[np.arange(n)[None, :], s - 1]  # [C, N]: E_i(s_i)
        longest_first = np.broadcast_to(np.argsort(-r, kind="stable"), e.shape)  # a closed batch's order
        order = np.argsort(-e, axis=-1, kind="stable") if self.open else longest_first
        e_o, s_o = np.take_along_axis(e, order, -1), np.take_along_axis(s, order, -1)
        costs = self._cost_grid(n, s.max(axis=1), n + np.cumsum(s_o - 1, axis=-1), floor)  # [C, N]
        if self.open:
            rates = (n + np.cumsum(e_o - 1.0, axis=-1)) / costs
        else:
            r_o = r[order].astype(float)
            tail = np.concatenate([r_o[:, 1:], np.zeros((len(r_o), 1))], axis=-1)  # max r past k
            rates = 1.0 / (np.maximum(np.maximum.accumulate(r_o / e_o, axis=-1), tail) * costs)
        plain_rate = self._rate(table[:, 0], r, plain_cost)
        cap, k = np.unravel_index(int(np.argmax(rates)), rates.shape)
        if rates[cap, k] <= plain_rate * (1.0 + SPEC_MARGIN):
            return Choice([1] * n, plain_rate, plain_cost)
        spans = [1] * n
        for i in order[cap, : k + 1].tolist():
            spans[i] = int(s[cap, i])
        return Choice(spans, float(rates[cap, k]), float(costs[cap, k]))
