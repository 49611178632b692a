"""Exact losslessness of the reference speculative-sampling rule, and the negative controls that must fail.

For seeded random target/drafter logit tables (a fresh row for every prefix, V <= 6, k <= 3 drafts), with
temperature / top-k / top-p applied to both sides and with one-hot (greedy) drafts, the exact enumeration
of one speculative step (golden.distribution.speculative.exact_check) must equal the target's joint over
k + 1 tokens to 1e-12. Each known bug (unnormalised residual, bonus from q, rejection falling back to p,
temperature on the drafts but not on the q used by accept, greedy acceptance at T > 0) must FAIL that
check by far more than the tolerance. Also: the reference step against hand-worked cases, and the logits
processing semantics (top-k ties kept, top-p smallest set >= p).

    PYTHONPATH=. python -m pytest tests/golden/test_distribution_exact.py -q -p no:cacheprovider
"""

from __future__ import annotations

import numpy as np
import pytest

from golden.distribution.processing import SamplingConfig, SamplingConfigError, one_hot, process_logits
from golden.distribution.speculative import (
    EXACT_TOL,
    Rule,
    SpeculativeInputError,
    exact_check,
    exact_distribution,
    speculative_step,
)

CONFIGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.5, top_k=3),
    SamplingConfig(temperature=0.9, top_p=0.8),
    SamplingConfig(temperature=1.2, top_k=4, top_p=0.9),
]


class Table:
    """A deterministic logits row per prefix: seeded by (seed, prefix), so p and q are fixed functions."""

    def __init__(self, seed: int, vocab: int, scale: float = 2.0, base: Table | None = None, noise: float = 1.0):
        self.seed, self.vocab, self.scale, self.base, self.noise = seed, vocab, scale, base, noise

    def logits(self, prefix: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(prefix), *prefix])
        own = rng.normal(0.0, self.scale, self.vocab)
        return own if self.base is None else self.base.logits(prefix) + self.noise * own


def model(seed: int, vocab: int, cfg: SamplingConfig, *, greedy: bool = False, noise: float = 1.0):
    target = Table(seed, vocab)
    drafter = Table(seed + 10_000, vocab, base=target, noise=noise)

    def p_fn(prefix):
        return process_logits(target.logits(prefix), cfg)

    def q_fn(prefix):
        if greedy:
            return one_hot(vocab, int(np.argmax(drafter.logits(prefix))))
        return process_logits(drafter.logits(prefix), cfg)

    return p_fn, q_fn, target, drafter


CASES = [(seed, 2 + seed % 5, 1 + seed % 3, CONFIGS[seed % len(CONFIGS)], seed % 4 == 3) for seed in range(30)]


@pytest.mark.parametrize("seed,vocab,k,cfg,greedy", CASES)
def test_correct_rule_is_exactly_lossless(seed, vocab, k, cfg, greedy):
    p_fn, q_fn, _, _ = model(seed, vocab, cfg, greedy=greedy)
    report = exact_check(p_fn, q_fn, k, vocab)
    assert report.passed, f"V={vocab} k={k} {cfg} greedy={greedy}: {report}"
    assert report.first_token_error <= EXACT_TOL, str(report)
    assert abs(report.total_mass - 1.0) <= EXACT_TOL, str(report)


def test_untempered_drafter_used_consistently_is_still_lossless():
    """Speculative sampling is lossless for ANY q the drafts truly come from: a drafter left at T = 1 while
    the target is at T = 0.6 only costs acceptance, never correctness (the control below is the bug)."""
    vocab, k = 5, 2
    p_fn, _, _, drafter = model(7, vocab, SamplingConfig(temperature=0.6))

    def q_raw(prefix):
        return process_logits(drafter.logits(prefix), SamplingConfig())

    report = exact_check(p_fn, q_raw, k, vocab)
    assert report.passed, str(report)


def _negative(rule_factory, cfg: SamplingConfig, greedy: bool = False):
    """Max error of a buggy rule over a few seeded models (V = 5, k = 2); it must fail on every one."""
    reports = []
    for seed in (101, 102, 103):
        p_fn, q_fn, _, drafter = model(seed, 5, cfg, greedy=greedy)
        report = exact_check(p_fn, q_fn, 2, 5, rule_factory(drafter))
        print(f"seed {seed}: {report}")
        reports.append(report)
    return reports


NEGATIVE_CONTROLS = {
    "residual left unnormalised": (lambda d: Rule(residual="unnormalized"), SamplingConfig(temperature=0.8), False),
    "bonus sampled from q": (lambda d: Rule(bonus="draft"), SamplingConfig(temperature=1.0, top_k=4), False),
    "rejection falls back to p": (lambda d: Rule(residual="target"), SamplingConfig(temperature=0.9), False),
    "rejection falls back to p, greedy drafts": (lambda d: Rule(residual="target"), SamplingConfig(), True),
    "temperature on the target, not on the q handed to accept": (
        lambda d: Rule(q_rule=lambda prefix: process_logits(d.logits(prefix), SamplingConfig())),
        SamplingConfig(temperature=0.5),
        False,
    ),
    "greedy acceptance at T > 0": (lambda d: Rule(accept="greedy"), SamplingConfig(temperature=1.0), False),
}


@pytest.mark.parametrize("label", sorted(NEGATIVE_CONTROLS))
def test_negative_control_fails_the_exact_check(label):
    factory, cfg, greedy = NEGATIVE_CONTROLS[label]
    reports = _negative(factory, cfg, greedy)
    failing = [r for r in reports if not r.passed and r.max_abs_error > 1e3 * EXACT_TOL]
    assert len(failing) == len(reports), f"{label}: the exact check did not flag the bug: " + "; ".join(
        str(r) for r in reports
    )
    assert min(r.max_abs_error for r in reports) > 1e-4, [r.max_abs_error for r in reports]


def test_step_hand_worked():
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.2, 0.6]])
    q = np.array([[0.25, 0.5, 0.25], [1.0, 0.0, 0.0]])
    # d0 = 1: ratio 0.3 / 0.5 = 0.6; u = 0.59 accepts, 0.61 rejects into norm(max(0, p0 - q0)) = [1, 0, 0]
    # ... then d1 = 0 (q1 one-hot): ratio 0.1, u = 0.99 rejects into [0, 0.1, 0.8] / 0.9; u = 0.5 -> token 2
    assert speculative_step(p, q, [1, 0], [0.59, 0.99], 0.5) == [1, 2]
    assert speculative_step(p, q, [1, 0], [0.61, 0.0], 0.99) == [0]
    # d0 = 0: ratio 2 -> always accepted; d1 = 0 accepted iff u < 0.1; else residual [0, 0.1, 0.8] / 0.9
    assert speculative_step(p, q, [0, 0], [0.999, 0.05], 0.7) == [0, 0, 2]  # bonus from p2 at u = 0.7
    assert speculative_step(p, q, [0, 0], [0.0, 0.2], 0.1) == [0, 1]  # 0.1 * 0.9 < 0.1: token 1
    assert speculative_step(p, q, [0, 0], [0.0, 0.2], 0.2) == [0, 2]
    with pytest.raises(SpeculativeInputError, match="cannot have been drafted"):
        speculative_step(p, q, [0, 1], [0.0, 0.0], 0.0)


def test_step_matches_enumeration_on_a_grid():
    """The step (uniform-driven) and the enumeration (probability-weighted) are separate code: on a midpoint
    grid of (draft, accept u, sample u) with k = 1 their committed-token frequencies agree to grid error."""
    vocab, n = 4, 120
    p_fn, q_fn, _, _ = model(5, vocab, SamplingConfig(temperature=0.8))
    q0 = q_fn(())
    grid = (np.arange(n) + 0.5) / n
    freq: dict[tuple[int, ...], float] = {}
    for d in range(vocab):
        p_rows = np.stack([p_fn(()), p_fn((d,))])
        for ua in grid:
            for us in grid:
                out = tuple(speculative_step(p_rows, q0[None, :], [d], [ua], us))
                freq[out] = freq.get(out, 0.0) + q0[d] / n**2
    exact = exact_distribution(p_fn, q_fn, 1, vocab)  # 2-token continuations: compare the first token
    first_grid = np.zeros(vocab)
    first_exact = np.zeros(vocab)
    for seq, w in freq.items():
        first_grid[seq[0]] += w
    for seq, w in exact.items():
        first_exact[seq[0]] += w
    err = float(np.abs(first_grid - first_exact).max())
    assert err < 3 * vocab / n, f"grid {first_grid} vs exact {first_exact}: max {err:.4f}"


def test_processing_semantics():
    logits = np.array([2.0, 1.0, 1.0, 0.0, -1.0])
    kept = process_logits(logits, SamplingConfig(top_k=2)) > 0
    assert kept.tolist() == [True, True, True, False, False], "top-k keeps every token tied at the k-th value"
    probs = process_logits(np.log(np.array([0.5, 0.3, 0.15, 0.05])), SamplingConfig(top_p=0.75))
    assert np.allclose(probs, [0.625, 0.375, 0, 0]), f"top-p 0.75: smallest set with mass >= 0.8, got {probs}"
    probs = process_logits(np.log(np.array([0.5, 0.3, 0.15, 0.05])), SamplingConfig(top_p=0.85))
    assert np.allclose(probs, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]), f"top-p 0.85, got {probs}"
    probs = process_logits(np.array([5.0, 0.0, 0.0]), SamplingConfig(top_p=0.01))
    assert probs.tolist() == [1.0, 0.0, 0.0], f"at least one token, got {probs}"
    t = process_logits(np.array([1.0, 0.0]), SamplingConfig(temperature=0.5))
    assert np.isclose(t[0], 1 / (1 + np.exp(-2.0))), f"temperature divides the logits, got {t}"
    # temperature before top-p: at T = 0.5 token 0 alone holds 0.78 >= 0.75 of the mass (0.6 at T = 1)
    probs = process_logits(np.log(np.array([0.6, 0.3, 0.1])), SamplingConfig(temperature=0.5, top_p=0.75))
    assert probs.tolist() == [1.0, 0.0, 0.0], f"temperature first, got {probs}"
    for bad in ({"temperature": 0.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(SamplingConfigError):
            SamplingConfig(**bad)
