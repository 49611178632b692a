"""The span choice of adaptive speculation, a pure function: given each request's acceptance estimate, its
remaining budget and the step-cost model, the verify span per request (1 = plain decode for it) that
maximises predicted committed tokens per second, or plain decode for all unless speculating is predicted
SPEC_MARGIN faster. refengine/spec_decode/adaptive.py keeps the state (estimates, exploration) around it.
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


def expected_tokens(alpha: float, span: int) -> float:
    """E[committed] for a span under geometric acceptance alpha: 1 + alpha + ... + alpha^(span-1)."""
    return float(span) if alpha >= 1.0 else (1.0 - alpha**span) / (1.0 - alpha)


@dataclass(frozen=True)
class Decision:
    spans: list[int]
    predicted_tok_per_s: float
    plain_tok_per_s: float  # the same step as plain decode (every span 1)
    cap: int  # the S of the winning candidate (1 = plain)
    searched: bool = True  # False: the upper bound showed plain wins, no span was evaluated


def _spec_bound(alphas: list[float], remaining: list[int], block: int, cost: CostModel, rows: RowsFn) -> float:
    """An upper bound on any speculating choice's rate: every request's largest gain over the cheapest
    speculating step. D and V are linear in the drafting requests and the executed rows, so their minima
    over a choice lie at the ends of those ranges, whatever the signs of the fitted slopes."""
    n = len(alphas)
    gain = sum(expected_tokens(a, min(block, r)) - 1.0 for a, r in zip(alphas, remaining) if r > 1)
    draft = min(cost.draft_s(1), cost.draft_s(n))
    verify = min(cost.verify_s(n, rows(n, n + 1)), cost.verify_s(n, rows(n, n * block)))
    return (n + gain) / (draft + verify)


def choose_spans(
    alphas: list[float], remaining: list[int], block: int, cost: CostModel, rows: RowsFn = real_rows
) -> Decision:
    """The span per request maximising predicted committed tokens / second (see the module docstring).

    Requests are switched to span 1 lowest acceptance first (for a common span the gain E(S) - 1 rises with
    the acceptance). O(B * N) arithmetic, skipped by an O(N) bound when plain clearly wins."""
    n = len(alphas)
    plain_rate = n / cost.plain_s(n)
    plain = Decision([1] * n, plain_rate, plain_rate, 1)
    if not any(r > 1 for r in remaining):
        return plain
    if _spec_bound(alphas, remaining, block, cost, rows) <= plain_rate * SPEC_MARGIN:
        return Decision([1] * n, plain_rate, plain_rate, 1, searched=False)
    order = sorted(range(n), key=lambda i: alphas[i])
    # cum[i][s] = E_i(s) for s = 0..block (E(0) = 0)
    cum = []
    for a in alphas:
        row, term, acc = [0.0], 1.0, 0.0
        for _ in range(block):
            acc += term
            row.append(acc)
            term *= a
        cum.append(row)
    draft_cost = [cost.draft_s(m) for m in range(n + 1)]
    executed = [rows(n, r) for r in range(n * block + 1)]  # by real rows: few distinct shapes
    by_shape = {x: cost.verify_s(n, x) for x in set(executed)}  # measured table, else the fit
    verify_cost = [by_shape[x] for x in executed]
    best_rate, best_k, best_cap = plain_rate * SPEC_MARGIN, 0, 1
    for cap in range(2, block + 1):
        spans = [cap if remaining[i] >= cap else max(1, remaining[i]) for i in order]
        gains = [cum[i][s] - 1.0 for i, s in zip(order, spans)]
        gain, total = sum(gains), sum(spans)
        drafted = sum(1 for s in spans if s > 1)
        for k in range(n):  # the k lowest-acceptance requests at span 1
            if k:
                gain -= gains[k - 1]
                total -= spans[k - 1] - 1
                drafted -= spans[k - 1] > 1
            if not drafted:
                break
            denom = draft_cost[drafted] + verify_cost[total]
            if denom > 0 and (n + gain) > best_rate * denom:
                best_rate, best_k, best_cap = (n + gain) / denom, k, cap
    if best_cap == 1:
        return plain
    chosen = [1] * n
    for rank, i in enumerate(order):
        if rank >= best_k:
            chosen[i] = max(1, min(best_cap, remaining[i]))
    return Decision(chosen, best_rate, plain_rate, best_cap)
