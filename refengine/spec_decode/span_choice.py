"""The span choice of adaptive speculation, a pure function: given each request's expected committed tokens
per span (refengine/spec_decode/acceptance_estimate.py), its remaining budget and the step-cost model, the
verify span per request (1 = plain decode for it) that maximises predicted committed tokens per second, or
plain decode for all unless speculating is predicted SPEC_MARGIN faster. refengine/spec_decode/adaptive.py
keeps the state (estimates, exploration) around it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from refengine.spec_decode.step_costs import CostModel

SPEC_MARGIN = 1.02  # speculation must be predicted this much faster than plain decode

RowsFn = Callable[[int, int], int]  # (requests, real rows) -> rows the verify actually computes


def real_rows(n: int, rows: int) -> int:
    """The eager runner computes exactly the step's rows."""
    return rows


Table = list[float]  # E(s), committed tokens expected from span s, for s = 0..B (E(0) = 0, E(1) = 1)


@dataclass(frozen=True)
class Decision:
    spans: list[int]
    predicted_tok_per_s: float
    plain_tok_per_s: float  # the same step as plain decode (every span 1)
    cap: int  # the S of the winning candidate (1 = plain)
    searched: bool = True  # False: the upper bound showed plain wins, no span was evaluated


def _spec_bound(tables: list[Table], remaining: list[int], block: int, cheapest_step_s: float) -> float:
    """An upper bound on any speculating choice's rate: every request's largest gain over the cheapest
    speculating step (the least draft over the drafting counts plus the least verify over the real rows a
    speculating step can have, both from the cost tables: measured tables need not be monotone, so the ends
    of the ranges are not enough)."""
    n = len(tables)
    gain = sum(e[min(block, r)] - 1.0 for e, r in zip(tables, remaining) if r > 1)  # E rises with the span
    return (n + gain) / cheapest_step_s


def executed_rows(rows: RowsFn, n: int, block: int) -> tuple[int, ...]:
    """rows(n, r) for r = 0..n*block: a step of n requests' executed rows by its real rows (the policy keeps
    it per n: graph shapes do not change)."""
    return tuple(rows(n, r) for r in range(n * block + 1))


def choose_spans(
    tables: list[Table],
    remaining: list[int],
    block: int,
    cost: CostModel,
    rows: RowsFn = real_rows,
    executed: tuple[int, ...] | None = None,
    switch_s: float = 0.0,
) -> Decision:
    """The span per request maximising predicted committed tokens / second (see the module docstring).

    For each cap, requests are switched to span 1 smallest gain E_i(s_i) - 1 first. O(B * N log N)
    arithmetic, skipped by an O(N) bound when plain clearly wins. `switch_s`: what any speculating choice
    pays on top of its draft and verify (the catch-up of context carried past a plain stretch)."""
    n = len(tables)
    plain_rate = n / cost.plain_step_s(n)
    plain = Decision([1] * n, plain_rate, plain_rate, 1)
    if not any(r > 1 for r in remaining):
        return plain
    draft_cost = _draft_costs_by_cap(cost, n, block, switch_s + cost.host_s("verify", n))
    if executed is None:
        executed = executed_rows(rows, n, block)  # by real rows: few distinct shapes
    shapes, of_rows = _shape_index(executed)
    verify_cost = np.array([cost.verify_s(n, x) for x in shapes])[of_rows]  # measured table, else the fit
    # the cheapest speculating step: drafting 1..n at any score cap, n+1.. real rows
    cheapest = float(draft_cost[:, 1:].min()) + float(verify_cost[n + 1 :].min())
    if _spec_bound(tables, remaining, block, cheapest) <= plain_rate * SPEC_MARGIN:
        return Decision([1] * n, plain_rate, plain_rate, 1, searched=False)
    if n == 1:  # c1: _search's candidates at k = 0 (k = 1 drafts nothing), without its arrays
        e, best_rate, best_cap, best_spans = tables[0], plain_rate * SPEC_MARGIN, 1, [1]
        for cap in range(2, min(block, remaining[0]) + 1):
            gain, denom = e[cap] - 1.0, draft_cost[cap - 2, 1] + verify_cost[cap]
            if denom > 0 and (1 + gain) > best_rate * denom:
                best_rate, best_cap, best_spans = (1 + gain) / denom, cap, [cap]
        return Decision(best_spans, best_rate, plain_rate, best_cap) if best_cap > 1 else plain
    # caps past the longest budget repeat the last spans at the same rate (the strict > took such a repeat
    # only on a rounding difference, which changed the recorded cap and nothing else): stop there
    found = _search(tables, remaining, min(block, max(remaining)), draft_cost, verify_cost)
    if found is None or not found[0] > plain_rate * SPEC_MARGIN:
        return plain
    return Decision(found[1], found[0], plain_rate, found[2])


def _draft_costs_by_cap(cost: CostModel, n: int, block: int, extra: float) -> np.ndarray:
    """(block - 1, n + 1): row S - 2 is [D(0), ..., D(n)] of a draft whose largest span is S (its graph's score
    cap: the LM head over fewer rows a block where every span is short, runner/graphs.py), plus `extra` (what
    any speculating step pays on top: a catch-up, the host's share). Computed once per distinct score cap."""
    rows: dict[object, list[float]] = {}
    out = np.empty((block - 1, n + 1))
    for s in range(2, block + 1):
        key = cost.draft_cap(s)
        if key not in rows:
            rows[key] = [d + extra for d in cost.draft_costs(n, s)]
        out[s - 2] = rows[key]
    return out


def _search(
    tables: list[Table], remaining: list[int], top: int, draft_cost: np.ndarray, verify_cost: np.ndarray
) -> tuple[float, list[int], int] | None:
    """The best speculating candidate: (rate, spans, cap), or None if none drafts. Candidates are every cap
    S = 2..top (each request at min(S, its budget)) with its k = 0..n-1 smallest-gain requests switched to span
    1, in that order, priced with cap S's draft (`draft_cost`: _draft_costs_by_cap); the first of the highest
    rate wins (tests/unit/test_span_search.py holds the plain
    enumeration it equals). One array pass: with it choose_spans costs ~0.24 ms at c32 on a 2-core CPU against
    ~0.6 ms as Python loops, and the policy's whole choice ~0.3 ms a speculating c32 step against ~0.8 ms
    (simulated tau-3 waves): run every speculating step, the loops were most of adaptive's host time a step in
    c32 waves (docs/PERF.md, twenty-third session)."""
    n = len(tables)
    caps = np.arange(2, top + 1)[:, None]  # (C, 1)
    rem = np.asarray(remaining)
    spans = np.where(rem >= caps, caps, np.maximum(rem, 1))  # (C, n): each cap's spans
    e = np.fromiter(itertools.chain.from_iterable(tables), float, n * len(tables[0])).reshape(n, -1)  # (n, B+1)
    gains = e[np.arange(n), spans] - 1.0  # (C, n): E_i(s_i) - 1
    # (C, n): largest gain first, so that column j keeps its j + 1 largest-gain requests drafting and the
    # k = n - 1 - j smallest at span 1 (the reversed stable ascending order: ties switch the lower index first)
    order = np.argsort(gains, axis=1, kind="stable")[:, ::-1]
    cap_rows = np.arange(len(spans))[:, None]
    kept = spans[cap_rows, order]
    gain = np.cumsum(gains[cap_rows, order], axis=1)
    total = n + np.cumsum(kept - 1, axis=1)  # real rows
    drafted = np.cumsum(kept > 1, axis=1)
    denom = draft_cost[cap_rows, drafted] + verify_cost[total]  # (row c: cap c + 2's draft shape)
    ok = (drafted > 0) & (denom > 0)
    rate = np.where(ok, (n + gain) / np.where(ok, denom, 1.0), -np.inf)
    best = int(np.argmax(rate[:, ::-1]))  # the first of the maxima in (cap, k) order
    c, k = divmod(best, n)
    if not ok[c, n - 1 - k]:
        return None
    chosen = spans[c].tolist()
    for i in order[c, n - k :].tolist():
        chosen[i] = 1
    return float(rate[c, n - 1 - k]), chosen, c + 2


@functools.lru_cache(maxsize=256)
def _shape_index(executed: tuple[int, ...]) -> tuple[list[int], np.ndarray]:
    """The distinct executed rows of `executed` (a step's rows by real rows) and, per real rows, the index of its
    shape among them: a verify's cost is looked up once per graph shape, not once per real row count."""
    shapes, of_rows = np.unique(np.asarray(executed), return_inverse=True)
    return shapes.tolist(), of_rows


def uniform_spec_costs(n: int, block: int, cost: CostModel, rows: RowsFn, regime: bool = False) -> list[float]:
    """[D(n) + V(n, R(n * S)) + H_verify(n) for S = 0..block] (S < 2 unused): a step where each of n requests
    drafts span S (its draft at that span's score cap); `regime`: H_verify as the plain-regime test prices it
    (CostModel.host_s)."""
    host = cost.host_s("verify", n, regime)
    return [0.0, 0.0, *(cost.draft_s(n, s) + host + cost.verify_s(n, rows(n, n * s)) for s in range(2, block + 1))]


def plain_wins_uniformly(table: Table, n: int, plain_s: float, spec_costs: list[float]) -> bool:
    """A batch of n requests each expected to commit `table`'s E(S) would decode plainly: at no common span S
    does n E(S) / (D(n) + V(n, R(nS))) beat n / P(n) by SPEC_MARGIN (`spec_costs`: uniform_spec_costs). The
    test of a request's retirement from speculation (refengine/spec_decode/adaptive.py)."""
    bar = SPEC_MARGIN / plain_s  # E(S) / cost(S) must exceed this for speculation to win
    return all(table[s] <= bar * spec_costs[s] for s in range(2, len(spec_costs)))
