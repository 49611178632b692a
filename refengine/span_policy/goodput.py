"""GoodputSpans (speculation="adaptive"): per step, the spans that maximise expected goodput, from measured
step costs (step_costs.py) and per-request acceptance estimates (acceptance.py). docs/PORTING.md states the
rule as math; in short, for N drafting requests with budgets left r_i, a candidate is a cap S (2, 4, 8, ...,
B) and the k requests that draft at it (span min(S, r_i); the rest span 1, a plain row):
    cost   C(0) = P(N)  (a plain step),   C(k, S) = D(k, S) + V(N, S)   (draft k blocks, verify N spans)
    tokens E_i(s_i), the tokens request i is expected to commit at span s_i
    rate   open batch (requests join as others finish):  sum_i E_i(s_i) / C          tokens a second
           closed batch (admitted together into an idle engine, nobody joining): 1 / (C x max_i r_i / E_i(s_i)),
           the inverse of its drain time: a closed batch lasts as long as its slowest request
For each S the requests are ranked (open: by E_i - 1; closed: by r_i, the longest first) and every prefix k is
priced; the best speculating candidate is taken only if its rate beats plain's by SPEC_MARGIN. Exploration:
the same search on optimistic estimates (OPTIMISM standard deviations up); where it chooses otherwise, it is
taken if its predicted regret, C_opt x (1 - rate_mean(opt) / rate_mean(best)), fits in EXPLORE_BUDGET of the
time observed so far. A kind of step not yet timed at this batch size is run once to time it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refengine.span_policy.acceptance import AcceptanceEstimates
from refengine.span_policy.base import EAGER_SHAPES, ShapeCost, SpanPolicy, StepReport, StepShapes
from refengine.span_policy.step_costs import StepCosts

SPEC_MARGIN = 0.05  # least predicted gain over plain to speculate: a wrong spec step loses more than a plain one
EXPLORE_BUDGET = 0.02  # exploration may cost at most this share of the time run (predicted regret)
OPTIMISM = 1.0  # exploration's estimates: this many posterior standard deviations above the mean


@dataclass(frozen=True)
class Choice:
    spans: list[int]
    rate: float  # the objective (tokens a second, or the inverse drain time)
    cost: float  # the step's predicted seconds


class GoodputSpans(SpanPolicy):
    name = "adaptive"

    def __init__(self, block_size: int):
        self.block = block_size
        self.caps = sorted({min(1 << i, block_size) for i in range(1, max(block_size, 2).bit_length())})
        self.estimates = AcceptanceEstimates(max(block_size, 2))
        self.costs = StepCosts()
        self.shapes = EAGER_SHAPES
        self.live: dict[int, int] = {}  # req -> budget
        self.open = False  # a request joined the batch after a step of it was chosen
        self._chosen = False  # a step was chosen since the batch last emptied
        self.elapsed_s = 0.0  # observed step time
        self.regret_s = 0.0  # predicted cost of the explorations taken
        self.counts: Counter = Counter()  # decisions: plain, spec, explored, timing
        self._draft_shapes: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> draft buckets of k = 1..n

    # ---- the seam ----------------------------------------------------------------------------------------
    def start(self, shapes: StepShapes, timed: Sequence[ShapeCost] = ()) -> None:
        self.shapes, self._draft_shapes = shapes, {}
        for c in timed:
            self.costs.seed(c.kind, c.bucket, c.cap, c.seconds)

    def admit(self, req_id: int, budget: int) -> None:
        if self.live and self._chosen:
            self.open = True
        self.live[req_id] = budget
        self.estimates.add(req_id)

    def release(self, req_id: int) -> None:
        self.live.pop(req_id, None)
        self.estimates.remove(req_id)
        if not self.live:
            self.open = self._chosen = False

    def choose(self, req_ids: Sequence[int], remaining: Sequence[int]) -> list[int]:
        self._chosen = True
        self.estimates.advance()
        r = np.minimum(np.asarray(remaining, dtype=np.int64), self.block)
        n = len(r)
        if self.block < 2 or n == 0 or r.max() < 2:
            return [1] * n
        untimed = self._untimed(r)
        if untimed is not None:
            self.counts["timing"] += 1
            return [int(x) for x in r] if untimed else [1] * n
        mean = self.estimates.tables(req_ids)
        best = self._search(mean, r)
        if self.regret_s < EXPLORE_BUDGET * self.elapsed_s:
            opt = self._search(self.estimates.tables(req_ids, OPTIMISM), r)
            if opt.spans != best.spans:
                rate, _ = self._evaluate(mean, r, opt.spans)
                regret = opt.cost * max(0.0, 1.0 - rate / best.rate)
                if self.regret_s + regret <= EXPLORE_BUDGET * (self.elapsed_s + opt.cost):
                    self.regret_s += regret
                    self.counts["explored"] += 1
                    best = opt
        self.counts["spec" if max(best.spans) > 1 else "plain"] += 1
        return best.spans

    def observe(self, report: StepReport) -> None:
        for rid, s, m in zip(report.req_ids, report.spans, report.accepted):
            if s > 1:
                self.estimates.observe(rid, s, m)
        if report.seconds is None:
            return
        sh, n, widest = self.shapes, len(report.spans), max(report.spans)
        if widest == 1:
            self.costs.observe("decode", sh.batch_bucket(n), 1, report.seconds)
        else:
            draft = report.draft_seconds or 0.0
            k, rows = sum(s > 1 for s in report.spans), sum(report.spans)
            self.costs.observe("draft", sh.draft_bucket(k), sh.draft_cap(widest), draft)
            self.costs.observe("verify", sh.batch_bucket(n), sh.verify_cap(n, rows), report.seconds - draft)
        self.elapsed_s += report.seconds

    def stats(self) -> dict:
        return {
            "decisions": dict(self.counts),
            "open_batch": self.open,
            "elapsed_s": round(self.elapsed_s, 4),
            "regret_s": round(self.regret_s, 4),
            "acceptance_by_position": [round(float(a), 3) for a in self.estimates.rates()],
            "shapes_timed": len(self.costs.measured),
        }

    # ---- the search --------------------------------------------------------------------------------------
    def _cost(self, spans: np.ndarray) -> float | None:
        """The predicted seconds of a step with these spans (all 1: a plain step)."""
        sh, n = self.shapes, len(spans)
        if spans.max() == 1:
            return self.costs.get("decode", sh.batch_bucket(n), 1)
        k, widest = int((spans > 1).sum()), int(spans.max())
        draft = self.costs.get("draft", sh.draft_bucket(k), sh.draft_cap(widest))
        verify = self.costs.get("verify", sh.batch_bucket(n), sh.verify_cap(n, int(spans.sum())))
        return None if draft is None or verify is None else draft + verify

    def _costs(self, n: int, rows: np.ndarray, widest: int) -> np.ndarray:
        """Predicted seconds of the steps drafting k = 1..n requests with `rows` [n] rows, [n]. Each distinct
        shape is priced once (with graphs: a few buckets and caps)."""
        sh = self.shapes
        if n not in self._draft_shapes:
            buckets = np.array([sh.draft_bucket(k) for k in range(1, n + 1)])
            self._draft_shapes[n] = np.unique(buckets, return_inverse=True)
        shapes, index = self._draft_shapes[n]
        cap = sh.draft_cap(widest)
        draft = np.array([self.costs.get("draft", int(b), cap) for b in shapes], dtype=float)[index]
        bucket = sh.batch_bucket(n)
        if sh.verify_caps and bucket in sh.batch_buckets:
            caps = np.asarray(sh.verify_caps)
            idx = np.minimum(np.searchsorted(bucket * caps, rows + bucket - n), len(caps) - 1)
            row_caps = caps[idx]
        else:
            row_caps = -(-rows // n)
        caps_u, inv = np.unique(row_caps, return_inverse=True)
        verify = np.array([self.costs.get("verify", bucket, int(c)) for c in caps_u], dtype=float)[inv]
        return draft + verify

    def _untimed(self, r: np.ndarray) -> bool | None:
        """True: no speculating step is priced yet (time one); False: no plain step is; None: both are."""
        if self._cost(r) is None:
            return True
        return False if self._cost(np.ones_like(r)) is None else None

    def _rate(self, e: np.ndarray, r: np.ndarray, cost: float | np.ndarray) -> float | np.ndarray:
        if self.open:
            return e.sum(axis=-1) / cost
        return 1.0 / (np.max(r / e, axis=-1) * cost)

    def _evaluate(self, table: np.ndarray, r: np.ndarray, spans: list[int]) -> tuple[float, float]:
        s = np.asarray(spans)
        cost = self._cost(s)
        assert cost is not None  # (every shape a search prices is priced: _untimed)
        return float(self._rate(table[np.arange(len(s)), s - 1], r, cost)), cost

    def _search(self, table: np.ndarray, r: np.ndarray) -> Choice:
        n = len(r)
        plain = [1] * n
        rate, cost = self._evaluate(table, r, plain)
        best, spec = Choice(plain, rate, cost), None
        for cap in self.caps:
            s = np.minimum(r, cap)
            e = table[np.arange(n), s - 1]  # E_i(s_i)
            order = np.argsort(-(e - 1.0) if self.open else -r, kind="stable")
            costs = self._costs(n, n + np.cumsum(s[order] - 1), int(s.max()))
            if self.open:
                rates = (n + np.cumsum(e[order] - 1.0)) / costs
            else:
                rr = r[order].astype(float)
                drained = np.maximum(np.maximum.accumulate(rr / e[order]), np.append(rr[1:], 0.0))
                rates = 1.0 / (drained * costs)
            k = int(np.argmax(rates))
            if spec is None or rates[k] > spec.rate:
                spans = plain.copy()
                for i in order[: k + 1]:
                    spans[i] = int(s[i])
                spec = Choice(spans, float(rates[k]), float(costs[k]))
        if spec is not None and spec.rate > best.rate * (1.0 + SPEC_MARGIN):
            best = spec
        return best
