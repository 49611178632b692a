"""The step-cost model of adaptive speculation: what a verify, a draft and a plain decode step cost, as linear
functions of their shape, fitted online by recursive least squares on the runner's GPU-synchronised timings.

- V(N, R) = v0 + v1*N + v2*R: a verify of N requests computing R rows (on the GPU: its graph shape's rows);
- D(M) = d0 + d1*M: a draft for M requests (0 when M = 0);
- P(N) = p0 + p1*N: a plain decode step of N requests (every span 1: no draft, the one-row decode graph).
P is its own curve because the decode graph is not the verify graph at one row per request. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FORGET = 0.98  # RLS forgetting factor: old samples fade over ~50 updates of a curve
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
