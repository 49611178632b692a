"""The distribution gate: an engine's sampled continuations against the oracle's conditionals, by PIT.

Each sampled token x at each position maps to u = F(before x) + v * p(x) under the oracle's conditional there,
F in probability-rank order
(v from a seeded stream keyed by the gate seed, the record name and the record's seed). If the engine
samples from the target's distribution, the pooled u's are i.i.d. U(0, 1); the gate fails when the KS or
the chi-square test rejects that at alpha (1e-3 each, so a correct engine fails with probability <= 2e-3),
or when a sampled token has probability 0 under the oracle (outside top-k / top-p: impossible, not rare).
Coverage is enforced (golden/coverage.py): every golden record needs its engine record, same prompt and
output ids. Fewer pooled positions than `min_positions` (default: stats.ks_sample_size(), the count that
detects a Kolmogorov distance of 0.05 with power 0.99) is a CoverageError: such a run cannot be gated to
the stated power.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from golden.coverage import Coverage, match_records
from golden.distribution.records import ConditionalRecord, SampleRecord
from golden.distribution.stats import ALPHA, UniformityReport, ks_sample_size, randomized_pit, uniformity
from golden.errors import CoverageError

PIT_SEED = 48  # the seed of the gate's own randomization stream (the PIT's uniforms)
ZERO_PROB = 1e-12  # a sampled token below this oracle probability counts as impossible


@dataclass(frozen=True)
class Impossible:
    name: str
    position: int  # index into output_ids
    token: int
    prob: float

    def __str__(self) -> str:
        return f"{self.name}[{self.position}]: token {self.token} has oracle probability {self.prob:.3g}"


@dataclass(frozen=True)
class DistributionReport:
    uniformity: UniformityReport
    impossible: list[Impossible] = field(default_factory=list)
    coverage: Coverage | None = None
    min_positions: int = 0

    @property
    def passed(self) -> bool:
        return self.uniformity.passed and not self.impossible

    def __str__(self) -> str:
        lines = [f"distribution gate {'PASS' if self.passed else 'FAIL'}: {self.uniformity}"]
        if self.coverage is not None:
            lines.append(f"  coverage: {self.coverage}; powered for >= {self.min_positions} positions")
        lines += [f"  impossible: {i}" for i in self.impossible[:10]]
        return "\n".join(lines)


def pit_values(pairs: Sequence[tuple[SampleRecord, ConditionalRecord]], seed: int = PIT_SEED) -> np.ndarray:
    out = []
    for e, g in pairs:
        rng = np.random.default_rng([seed, zlib.crc32(g.name.encode()), e.seed & 0xFFFFFFFF])
        v = rng.random(len(g.output_ids))
        out += [randomized_pit(c, p, float(vi)) for c, p, vi in zip(g.cdf_below, g.prob, v)]
    return np.clip(np.asarray(out, dtype=np.float64), 0.0, 1.0)


def distribution_gate(
    engine: Sequence[SampleRecord],
    golden: Sequence[ConditionalRecord],
    *,
    alpha: float = ALPHA,
    min_positions: int | None = None,
    names: Sequence[str] | None = None,
    seed: int = PIT_SEED,
) -> DistributionReport:
    """Gate the engine's samples against the oracle's conditionals (see the module docstring)."""
    pairs, coverage = match_records(
        engine, golden, what="conditional golden", ids=lambda r: r.ids, ids_label="prompt + output ids", names=names
    )
    need = ks_sample_size(alpha=alpha) if min_positions is None else min_positions
    n = sum(len(g.output_ids) for _, g in pairs)
    if n < need:
        raise CoverageError(
            f"{n} sampled positions in {len(pairs)} records, fewer than the {need} the gate needs for power 0.99 "
            f"against a 0.05 error at alpha {alpha:g} (golden.distribution.stats.ks_sample_size)"
        )
    impossible = [
        Impossible(g.name, i, g.output_ids[i], p) for _, g in pairs for i, p in enumerate(g.prob) if p < ZERO_PROB
    ]
    return DistributionReport(
        uniformity=uniformity(pit_values(pairs, seed), alpha=alpha),
        impossible=impossible,
        coverage=coverage,
        min_positions=need,
    )
