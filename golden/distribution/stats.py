"""The statistics of the distribution gate: randomized PIT, Kolmogorov-Smirnov, chi-square, and the power.

Randomized probability-integral transform: a token x drawn from a distribution p (CDF F over the tokens
in probability-rank order: most probable first, ties by lower id) maps to u = F(x-) + v * p(x), v ~ U(0, 1)
independent, F(x-) the mass ranked before x. If x ~ p then u ~ U(0, 1) exactly; over
a sequence whose every token is drawn from the target's conditional given the tokens before it, the u's are
i.i.d. U(0, 1) (the Rosenblatt transform), so all sampled positions of all samples pool into one i.i.d.
sample. Both tests below are implemented here from their formulas (stdlib + numpy, no scipy).

Power (`ks_sample_size`): let G be the pooled PIT's CDF under an engine whose sampling is wrong, at
Kolmogorov distance eps = sup_u |G(u) - u|. The KS test rejects when sqrt(n) D_n > c_alpha, c_alpha the
Kolmogorov quantile (K(c_alpha) = 1 - alpha). At the u* where |G - u| = eps, D_n >= eps - sup|G_n - G|;
by the Dvoretzky-Kiefer-Wolfowitz inequality (Massart's constant, valid for every n and every G)
P(sup|G_n - G| > c_beta / sqrt(n)) <= 2 exp(-2 c_beta^2) = beta. So with probability >= 1 - beta the test
rejects once eps - c_beta / sqrt(n) > c_alpha / sqrt(n), i.e. n >= ((c_alpha + c_beta) / eps)^2. At
alpha = 1e-3, beta = 0.01, eps = 0.05: c_alpha = 1.9495, c_beta = sqrt(ln(200) / 2) = 1.6276, n = 5119
(71.54^2 = 5118.2, rounded up).
How a TV error becomes a Kolmogorov distance: G(F(x)) = F'(x), the CDF of the engine's distribution p'
in the same rank order, so eps = max_x |F'(x) - F(x)| <= TV(p, p'), with equality when p' - p changes sign
once along the rank order: the engine over-samples the likely tokens and under-samples the unlikely ones
(too low a temperature, greedy acceptance, a top-k/top-p cut too tight) or the reverse (too high a
temperature, a residual that favours the tail). That is why the order is by rank, not by id: along ids a
one-token bump at a random id points in a different direction at each position and cancels in the pooled
PIT (observed: a 0.1 TV bump on the argmax passed at n = 5120 in id order). In general eps >= TV / r when
p' - p changes sign r - 1 times along the ranks, and errors pointing in different directions at different
positions can still cancel in the pool. The gate detects systematic errors; the exact enumeration
(speculative.py) is what proves the rule itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from golden.errors import GoldenError

ALPHA = 1e-3
POWER = 0.99
TV_DETECT = 0.05
CHI2_BINS = 20


class StatsError(GoldenError):
    """Statistics asked of impossible input (no values, values outside [0, 1], a bad level)."""


def randomized_pit(cdf_below: float, prob: float, v: float) -> float:
    """u = F(x-) + v * p(x) for the sampled token x (cdf_below = F(x-), the mass ranked before x; prob = p(x))."""
    return cdf_below + v * prob


def kolmogorov_sf(lam: float) -> float:
    """P(sqrt(n) D_n > lam) in the limit: 2 sum_{j>=1} (-1)^(j-1) exp(-2 j^2 lam^2)."""
    if lam <= 0.0:
        return 1.0
    if lam < 0.2:  # the alternating series converges slowly here; the value is 1 to double precision
        return 1.0
    total = 0.0
    for j in range(1, 101):
        term = math.exp(-2.0 * j * j * lam * lam)
        total += term if j % 2 else -term
        if term < 1e-17:
            break
    return min(1.0, max(0.0, 2.0 * total))


def kolmogorov_quantile(alpha: float) -> float:
    """c with kolmogorov_sf(c) = alpha (bisection)."""
    if not 0.0 < alpha < 1.0:
        raise StatsError(f"alpha must be in (0, 1), got {alpha}")
    lo, hi = 0.2, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kolmogorov_sf(mid) > alpha else (lo, mid)
    return (lo + hi) / 2


def ks_statistic(u: Sequence[float] | np.ndarray) -> float:
    """D_n = sup_t |F_n(t) - t| of the sample against U(0, 1)."""
    x = np.sort(np.asarray(u, dtype=np.float64))
    n = x.size
    if n == 0:
        raise StatsError("KS statistic of no values")
    if x[0] < 0.0 or x[-1] > 1.0:
        raise StatsError(f"PIT values outside [0, 1]: min {x[0]}, max {x[-1]}")
    i = np.arange(1, n + 1)
    return float(max((i / n - x).max(), (x - (i - 1) / n).max()))


def ks_pvalue(d: float, n: int) -> float:
    """Asymptotic p-value with Stephens' small-sample correction: lam = (sqrt(n) + 0.12 + 0.11 / sqrt(n)) d."""
    s = math.sqrt(n)
    return kolmogorov_sf((s + 0.12 + 0.11 / s) * d)


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series below a + 1, Lentz continued fraction above)."""
    if x <= 0.0:
        return 1.0
    lg = math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - lg))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(-x + a * math.log(x) - lg) * h


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x)."""
    return _gamma_q(df / 2.0, x / 2.0)


def chi2_uniform(u: Sequence[float] | np.ndarray, bins: int = CHI2_BINS) -> tuple[float, float, list[int]]:
    """Pearson's chi-square of the PIT values in `bins` equal bins of [0, 1]: (statistic, p-value, counts)."""
    x = np.asarray(u, dtype=np.float64)
    if x.size == 0:
        raise StatsError("chi-square of no values")
    counts = np.bincount(np.minimum((x * bins).astype(np.int64), bins - 1), minlength=bins)
    expected = x.size / bins
    stat = float(((counts - expected) ** 2).sum() / expected)
    return stat, chi2_sf(stat, bins - 1), [int(c) for c in counts]


def ks_sample_size(eps: float = TV_DETECT, alpha: float = ALPHA, power: float = POWER) -> int:
    """PIT values needed so that a Kolmogorov distance eps fails the KS test at `alpha` with prob >= power:
    n = ceil(((c_alpha + c_beta) / eps)^2), c_beta = sqrt(ln(2 / beta) / 2) (DKW), beta = 1 - power."""
    if not 0.0 < eps < 1.0 or not 0.0 < power < 1.0:
        raise StatsError(f"want 0 < eps < 1 and 0 < power < 1, got eps={eps} power={power}")
    c_alpha = kolmogorov_quantile(alpha)
    c_beta = math.sqrt(math.log(2.0 / (1.0 - power)) / 2.0)
    return math.ceil(((c_alpha + c_beta) / eps) ** 2)


@dataclass(frozen=True)
class UniformityReport:
    n: int
    ks: float  # D_n
    ks_p: float
    chi2: float
    chi2_p: float
    counts: list[int]  # per chi-square bin
    alpha: float

    @property
    def passed(self) -> bool:
        return self.ks_p >= self.alpha and self.chi2_p >= self.alpha

    def __str__(self) -> str:
        return (
            f"{self.n} PIT values: KS D = {self.ks:.4f} (p {self.ks_p:.3g}), chi-square {self.chi2:.1f} on "
            f"{len(self.counts) - 1} df (p {self.chi2_p:.3g}), alpha {self.alpha:g}"
        )


def uniformity(u: Sequence[float] | np.ndarray, alpha: float = ALPHA, bins: int = CHI2_BINS) -> UniformityReport:
    x = np.asarray(u, dtype=np.float64)
    d = ks_statistic(x)
    stat, p, counts = chi2_uniform(x, bins)
    return UniformityReport(
        n=int(x.size), ks=d, ks_p=ks_pvalue(d, int(x.size)), chi2=stat, chi2_p=p, counts=counts, alpha=alpha
    )
