"""The span choice of adaptive speculation, a pure function: given each request's expected committed tokens
per span (refengine/spec_decode/acceptance_estimate.py), its remaining budget and the step-cost model, the
verify span per request (1 = plain decode for it) that maximises predicted committed tokens per second, or
plain decode for all unless speculating is predicted SPEC_MARGIN faster. refengine/spec_decode/adaptive.py
keeps the state (estimates, exploration) around it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def _spec_bound(
    tables: list[Table], remaining: list[int], block: int, cost: CostModel, rows: RowsFn, switch_s: float = 0.0
) -> float:
    """An upper bound on any speculating choice's rate: every request's largest gain over the cheapest
    speculating step. D and V are linear in the drafting requests and the executed rows, so their minima
    over a choice lie at the ends of those ranges, whatever the signs of the fitted slopes."""
    n = len(tables)
    gain = sum(e[min(block, r)] - 1.0 for e, r in zip(tables, remaining) if r > 1)  # E rises with the span
    draft = min(cost.draft_s(1), cost.draft_s(n))
    verify = min(cost.verify_s(n, rows(n, n + 1)), cost.verify_s(n, rows(n, n * block)))
    return (n + gain) / (draft + verify + switch_s)


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
    plain_rate = n / cost.plain_s(n)
    plain = Decision([1] * n, plain_rate, plain_rate, 1)
    if not any(r > 1 for r in remaining):
        return plain
    if _spec_bound(tables, remaining, block, cost, rows, switch_s) <= plain_rate * SPEC_MARGIN:
        return Decision([1] * n, plain_rate, plain_rate, 1, searched=False)
    draft_cost = [cost.draft_s(m) + switch_s for m in range(n + 1)]
    if executed is None:
        executed = executed_rows(rows, n, block)  # by real rows: few distinct shapes
    by_shape = {x: cost.verify_s(n, x) for x in set(executed)}  # measured table, else the fit
    verify_cost = [by_shape[x] for x in executed]
    best_rate, best_k, best_cap = plain_rate * SPEC_MARGIN, 0, 1
    best_spans: list[int] = []
    best_order: list[int] = []
    if n == 1:  # c1: the loop below at k = 0 (k = 1 drafts nothing), without its per-cap lists
        e = tables[0]
        for cap in range(2, min(block, remaining[0]) + 1):
            gain, denom = e[cap] - 1.0, draft_cost[1] + verify_cost[cap]
            if denom > 0 and (1 + gain) > best_rate * denom:
                best_rate, best_cap, best_spans = (1 + gain) / denom, cap, [cap]
        return Decision(best_spans, best_rate, plain_rate, best_cap) if best_cap > 1 else plain
    # caps past the longest budget repeat the last spans at the same rate (the strict > took such a repeat
    # only on a rounding difference, which changed the recorded cap and nothing else): stop there
    for cap in range(2, min(block, max(remaining)) + 1):
        spans = [cap if r >= cap else max(1, r) for r in remaining]
        gains = [e[s] - 1.0 for e, s in zip(tables, spans)]
        order = sorted(range(n), key=gains.__getitem__)
        gain, total = sum(gains), sum(spans)
        drafted = sum(1 for s in spans if s > 1)
        for k in range(n):  # the k smallest-gain requests at span 1
            if k:
                i = order[k - 1]
                gain -= gains[i]
                total -= spans[i] - 1
                drafted -= spans[i] > 1
            if not drafted:
                break
            denom = draft_cost[drafted] + verify_cost[total]
            if denom > 0 and (n + gain) > best_rate * denom:
                best_rate, best_k, best_cap = (n + gain) / denom, k, cap
                best_spans, best_order = spans, order
    if best_cap == 1:
        return plain
    chosen = list(best_spans)
    for i in best_order[:best_k]:
        chosen[i] = 1
    return Decision(chosen, best_rate, plain_rate, best_cap)


def uniform_spec_costs(n: int, block: int, cost: CostModel, rows: RowsFn) -> list[float]:
    """[D(n) + V(n, R(n * S)) for S = 0..block] (S < 2 unused): a step where each of n requests drafts span S."""
    draft = cost.draft_s(n)
    return [0.0, 0.0, *(draft + cost.verify_s(n, rows(n, n * s)) for s in range(2, block + 1))]


def plain_wins_uniformly(table: Table, n: int, plain_s: float, spec_costs: list[float]) -> bool:
    """A batch of n requests each expected to commit `table`'s E(S) would decode plainly: at no common span S
    does n E(S) / (D(n) + V(n, R(nS))) beat n / P(n) by SPEC_MARGIN (`spec_costs`: uniform_spec_costs). The
    test of a request's retirement from speculation (refengine/spec_decode/adaptive.py)."""
    bar = SPEC_MARGIN / plain_s  # E(S) / cost(S) must exceed this for speculation to win
    return all(table[s] <= bar * spec_costs[s] for s in range(2, len(spec_costs)))
