"""Adaptive speculation: per step, each speculating request's verify span (1 = plain decode for it), chosen
to maximise expected committed tokens per second. Pure Python (no torch): the scheduler feeds it measured
step costs and per-request acceptance, and asks it for spans.

Model (all online, with priors):
- acceptance: each request has a per-position acceptance rate a_i, the decayed maximum-likelihood estimate of
  a geometric acceptance model: a_i = (s_i + 1) / (s_i + f_i + 2), where after every verify step of span S
  accepting m drafts s_i <- DECAY*s_i + m and f_i <- DECAY*f_i + [m < S-1] (a rejection was seen). The
  expected tokens a span S commits are E_i(S) = 1 + a_i + ... + a_i^(S-1).
- cost: a verify step of N requests and R total rows costs V(N, R) = v0 + v1*N + v2*R seconds; a draft step
  for M requests D(M) = d0 + d1*M (0 when M = 0); a step where every span is 1 runs no draft and is a plain
  decode step (the runner replays the one-row decode graph, taps included), P(N) = p0 + p1*N. P is its own
  curve because on the GPU a verify graph is padded to B rows per request, so V is not continuous down to
  R = N. All three are fitted by recursive least squares (forgetting factor FORGET) on the runner's
  GPU-synchronised timings, starting from priors.
- decision: for each cap S in 2..B, every request gets s_i = min(S, remaining_i); requests are then switched to
  span 1 lowest gain first (k = 0..K), and the choice maximising
      sum_i E_i(s_i) / (D(#requests with s_i > 1) + V(N, sum_i s_i))
  wins against plain decode's N / P(N), so a spec choice is only taken when its predicted rate beats plain's.
- exploration: the losing kind (plain vs. speculating at full span) is tried every `interval` steps so its
  curve and the acceptance estimates stay measured; the interval doubles (16 .. 128) while the choice is
  confirmed and drops back to 16 when it flips. A request with no acceptance evidence drafts a full block once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

DECAY = 0.9
FORGET = 0.98
MIN_EXPLORE, MAX_EXPLORE = 16, 128
# Prior variances (ms^2) of (per step, per request, per row): a step's cost is mostly fixed (memory-bound), so
# the intercept is free to move and the slopes move slowly unless the data insist.
VAR_STEP, VAR_REQUEST, VAR_ROW = 100.0, 1.0, 0.01


class _Rls:
    """Recursive least squares y ~ theta . x with forgetting, in plain Python (dimension 2 or 3)."""

    def __init__(self, theta: list[float], variances: list[float]):
        n = len(theta)
        self.theta = list(theta)
        self.p = [[variances[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.updates = 0

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def update(self, x: list[float], y: float) -> None:
        n = len(x)
        px = [sum(self.p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = FORGET + sum(x[i] * px[i] for i in range(n))
        k = [v / denom for v in px]
        err = y - self.predict(x)
        self.theta = [t + ki * err for t, ki in zip(self.theta, k)]
        self.p = [[(self.p[i][j] - k[i] * px[j]) / FORGET for j in range(n)] for i in range(n)]
        self.updates += 1


@dataclass
class CostModel:
    """V(N, R), D(M), P(N), fitted in milliseconds (RLS assumes unit noise: ~1 ms), read in seconds. Priors:
    a memory-bound step (the fixed cost dominates), drafts cheaper."""

    verify: _Rls = field(default_factory=lambda: _Rls([5.0, 0.05, 0.02], [VAR_STEP, VAR_REQUEST, VAR_ROW]))
    draft: _Rls = field(default_factory=lambda: _Rls([2.0, 0.1], [VAR_STEP, VAR_REQUEST]))
    plain: _Rls = field(default_factory=lambda: _Rls([5.0, 0.07], [VAR_STEP, VAR_REQUEST]))

    @classmethod
    def linear(
        cls, v0: float, v1: float, v2: float, d0: float, d1: float, p0: float | None = None, p1: float | None = None
    ) -> CostModel:
        """A fixed model (tests, calibration results); plain decode defaults to V(N, N)."""
        m = cls()
        p0, p1 = v0 if p0 is None else p0, v1 + v2 if p1 is None else p1
        m.verify.theta, m.draft.theta, m.plain.theta = (
            [v0 * 1e3, v1 * 1e3, v2 * 1e3],
            [d0 * 1e3, d1 * 1e3],
            [p0 * 1e3, p1 * 1e3],
        )
        return m

    def plain_s(self, n: int) -> float:
        return max(self.plain.predict([1.0, n]), 1e-3) * 1e-3

    def verify_s(self, n: int, rows: int) -> float:
        return max(self.verify.predict([1.0, n, rows]), 1e-3) * 1e-3

    def draft_s(self, m: int) -> float:
        return max(self.draft.predict([1.0, m]), 0.0) * 1e-3 if m else 0.0

    def observe(self, n: int, rows: int, drafted: int, draft_s: float, verify_s: float) -> None:
        if not drafted and rows == n:
            self.plain.update([1.0, n], verify_s * 1e3)
            return
        self.verify.update([1.0, n, rows], verify_s * 1e3)
        if drafted:
            self.draft.update([1.0, drafted], draft_s * 1e3)


def expected_tokens(alpha: float, span: int) -> float:
    """E[committed] for a span under geometric acceptance alpha: 1 + alpha + ... + alpha^(span-1)."""
    return float(span) if alpha >= 1.0 else (1.0 - alpha**span) / (1.0 - alpha)


@dataclass(frozen=True)
class Decision:
    spans: list[int]
    predicted_tok_per_s: float
    plain_tok_per_s: float  # the same step as plain decode (every span 1)
    cap: int  # the S of the winning candidate (1 = plain)


def choose_spans(alphas: list[float], remaining: list[int], block: int, cost: CostModel) -> Decision:
    """The span per request maximising predicted committed tokens / second (see the module docstring).

    Requests are switched to span 1 lowest acceptance first (for a common span the gain E(S) - 1 rises with
    the acceptance). O(B * N) arithmetic: well under a millisecond at N = 32, B = 16."""
    n = len(alphas)
    plain_rate = n / cost.plain_s(n)
    best = Decision([1] * n, plain_rate, plain_rate, 1)
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
    v0, v1, v2 = (t * 1e-3 for t in cost.verify.theta)
    v_fixed = v0 + v1 * n
    best_rate, best_k, best_cap = plain_rate * (1 + 1e-9), 0, 1
    for cap in range(2, block + 1):
        spans = [cap if remaining[i] >= cap else max(1, remaining[i]) for i in order]
        gains = [cum[i][s] - 1.0 for i, s in zip(order, spans)]
        gain, extra = sum(gains), sum(spans) - n
        drafted = sum(1 for s in spans if s > 1)
        for k in range(n):  # the k lowest-acceptance requests at span 1
            if k:
                gain -= gains[k - 1]
                extra -= spans[k - 1] - 1
                drafted -= spans[k - 1] > 1
            if not drafted:
                break
            denom = draft_cost[drafted] + v_fixed + v2 * (n + extra)
            if denom > 0 and (n + gain) > best_rate * denom:
                best_rate, best_k, best_cap = (n + gain) / denom, k, cap
    if best_cap == 1:
        return best
    chosen = [1] * n
    for rank, i in enumerate(order):
        if rank >= best_k:
            chosen[i] = max(1, min(best_cap, remaining[i]))
    return Decision(chosen, best_rate, plain_rate, best_cap)


@dataclass
class AdaptivePolicy:
    """The scheduler's span chooser in `speculation="adaptive"` mode, with its visible statistics."""

    block_size: int
    cost: CostModel = field(default_factory=CostModel)
    counts: dict[int, tuple[float, float]] = field(default_factory=dict)  # req -> (accepted, rejected)
    interval: int = MIN_EXPLORE
    steps: int = 0
    explored: int = 0
    caps: Counter = field(default_factory=Counter)  # winning S per decision (1 = plain)
    last: Decision | None = None
    _explored_kind: bool | None = None  # at the last exploration, was speculating the choice?
    last_mean_alpha: float | None = None
    _decisions_before: int = 0

    def reset_stats(self) -> None:
        """Zero the decision counters (bench rows); the learnt costs and acceptance estimates stay."""
        self.explored, self.caps = 0, Counter()
        self._decisions_before = self.steps

    def alpha(self, req_id: int) -> float:
        s, f = self.counts.get(req_id, (0.0, 0.0))
        return (s + 1.0) / (s + f + 2.0)  # 0.5 before any evidence

    def choose(self, req_ids: list[int], remaining: list[int]) -> list[int]:
        alphas = [self.alpha(r) for r in req_ids]
        d = choose_spans(alphas, remaining, self.block_size, self.cost)
        self.last_mean_alpha = sum(alphas) / len(alphas)
        self.steps += 1
        explore = self.steps <= 2 or self.steps % self.interval == 0
        if explore:  # try the other kind: full spans if plain wins, plain if speculating wins
            try_spec = self.steps == 1 if self.steps <= 2 else d.cap == 1
            if self.steps > 2:
                same = self._explored_kind == (d.cap > 1)
                self._explored_kind = d.cap > 1
                self.interval = min(self.interval * 2, MAX_EXPLORE) if same else MIN_EXPLORE
            self.explored += 1
            self.last = d
            return [max(1, min(self.block_size, r)) for r in remaining] if try_spec else [1] * len(req_ids)
        self.caps[d.cap] += 1
        self.last = d
        fresh = [i for i, r in enumerate(req_ids) if r not in self.counts and remaining[i] > 1]
        if any(d.spans[i] == 1 for i in fresh):
            # a request with no acceptance evidence yet drafts a full block once, so it gets some
            spans = list(d.spans)
            for i in fresh:
                spans[i] = min(self.block_size, remaining[i])
            self.explored += 1
            return spans
        return d.spans

    def observe_step(self, n: int, rows: int, drafted: int, draft_s: float, verify_s: float) -> None:
        self.cost.observe(n, rows, drafted, draft_s, verify_s)

    def observe_acceptance(self, req_id: int, span: int, accepted: int) -> None:
        if span <= 1:
            return  # no drafts: nothing learnt about acceptance
        s, f = self.counts.get(req_id, (0.0, 0.0))
        self.counts[req_id] = (DECAY * s + accepted, DECAY * f + (1.0 if accepted < span - 1 else 0.0))

    def release(self, req_id: int) -> None:
        self.counts.pop(req_id, None)

    def summary(self) -> dict:
        """The policy's inputs and decisions, for stats / bench JSON (times in ms)."""
        v, d, p = ([t * 1e-3 for t in m.theta] for m in (self.cost.verify, self.cost.draft, self.cost.plain))
        return {
            "decisions": self.steps - self._decisions_before,
            "explored": self.explored,
            "chosen_cap_hist": {str(k): v for k, v in sorted(self.caps.items())},
            "verify_ms_model": {
                "per_step": round(v[0] * 1e3, 4),
                "per_request": round(v[1] * 1e3, 5),
                "per_row": round(v[2] * 1e3, 5),
                "fits": self.cost.verify.updates,
            },
            "draft_ms_model": {
                "per_step": round(d[0] * 1e3, 4),
                "per_request": round(d[1] * 1e3, 5),
                "fits": self.cost.draft.updates,
            },
            "plain_ms_model": {
                "per_step": round(p[0] * 1e3, 4),
                "per_request": round(p[1] * 1e3, 5),
                "fits": self.cost.plain.updates,
            },
            "last_predicted_tok_per_s": round(self.last.predicted_tok_per_s, 2) if self.last else None,
            "last_plain_tok_per_s": round(self.last.plain_tok_per_s, 2) if self.last else None,
            "last_mean_acceptance_alpha": round(self.last_mean_alpha, 4) if self.last_mean_alpha is not None else None,
        }
