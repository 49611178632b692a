"""Monte Carlo checks of the distribution gate's statistics (golden/distribution/stats.py).

Calibration: on 1000 seeded samples of 5119 true uniforms, the KS and chi-square p-values reject at
alpha 0.05 in 3-7% of runs (binomial sd 0.7%) and at alpha 1e-3 in at most 1% of runs. Power: on 300
seeded samples of ks_sample_size() = 5119 PIT values at Kolmogorov distance exactly 0.05 (mass 0.05 moved
from the top of [0, 1] to the bottom, the shape a sharpened sampler gives), the KS test at alpha 1e-3
rejects in >= 97% of runs (the derivation promises >= 99%; 97% leaves binomial slack). Failures print the
rates.

    PYTHONPATH=. python -m pytest tests/golden/test_distribution_stats.py -q -p no:cacheprovider
"""

from __future__ import annotations

import numpy as np

from golden.distribution.stats import ALPHA, chi2_uniform, ks_pvalue, ks_sample_size, ks_statistic

N = ks_sample_size()


def test_null_calibration():
    rng = np.random.default_rng(2026)
    ks_p, chi_p = [], []
    for _ in range(1000):
        u = rng.random(N)
        ks_p.append(ks_pvalue(ks_statistic(u), N))
        chi_p.append(chi2_uniform(u)[1])
    ks_p_arr, chi_p_arr = np.array(ks_p), np.array(chi_p)
    rates = {
        "ks@0.05": float((ks_p_arr < 0.05).mean()),
        "chi2@0.05": float((chi_p_arr < 0.05).mean()),
        "ks@1e-3": float((ks_p_arr < ALPHA).mean()),
        "chi2@1e-3": float((chi_p_arr < ALPHA).mean()),
    }
    print(rates)
    assert 0.03 <= rates["ks@0.05"] <= 0.07 and 0.03 <= rates["chi2@0.05"] <= 0.07, rates
    assert rates["ks@1e-3"] <= 0.01 and rates["chi2@1e-3"] <= 0.01, rates


def test_power_at_kolmogorov_distance_005():
    rng = np.random.default_rng(48)
    rejected, ds = 0, []
    for _ in range(300):
        u = rng.random(N)
        u = np.where(u > 0.95, u - 0.95, u)  # G(u) = 2u below 0.05, u + 0.05 up to 0.95: sup |G - u| = 0.05
        d = ks_statistic(u)
        ds.append(d)
        rejected += ks_pvalue(d, N) < ALPHA
    rate = rejected / 300
    print(f"n = {N}: KS rejected {rate:.3f} of 300 runs; D mean {np.mean(ds):.4f}, min {np.min(ds):.4f}")
    assert rate >= 0.97, f"power {rate:.3f} < 0.97 at n = {N} (D mean {np.mean(ds):.4f}, min {np.min(ds):.4f})"
