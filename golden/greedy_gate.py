"""The greedy gate: an engine's greedy outputs against the HF greedy goldens, token for token.

In fp32 an engine's greedy output equals HF's exactly; every record that does not is reported with its
first divergent generated position and the tokens around it on both sides. (Under bf16, gate the
divergence instead: golden.gates.first_divergence_regret_gate tells a tie flip from a bug.)
Coverage is enforced as in every gate (golden/coverage.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from golden.coverage import Coverage, first_difference, match_records
from golden.records import GreedyRecord

CONTEXT = 3  # tokens shown on each side of a divergence


@dataclass(frozen=True)
class GreedyMismatch:
    name: str
    position: int  # first divergent index into the generated tokens
    got_len: int
    want_len: int
    context_start: int  # generated index of got[0] / want[0]
    got: list[int]
    want: list[int]

    def __str__(self) -> str:
        return (
            f"{self.name}: first divergence at generated position {self.position} (lengths got "
            f"{self.got_len}, want {self.want_len}); tokens from position {self.context_start}: got "
            f"{self.got} want {self.want}"
        )


@dataclass
class GreedyReport:
    coverage: Coverage
    records: int = 0
    identical: int = 0
    tokens: int = 0  # golden tokens compared
    mismatches: list[GreedyMismatch] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        lines = [
            f"greedy gate {'PASS' if self.passed else 'FAIL'}: {self.identical} of {self.records} records "
            f"identical ({self.coverage}), {self.tokens} golden tokens; mismatches {len(self.mismatches)}"
        ]
        lines += [f"  {m}" for m in self.mismatches[:20]]
        if len(self.mismatches) > 20:
            lines.append(f"  ... {len(self.mismatches) - 20} more mismatches")
        return "\n".join(lines)

    def assert_passes(self) -> None:
        if not self.passed:
            raise AssertionError(str(self))


def greedy_gate(
    engine: Sequence[GreedyRecord], golden: Sequence[GreedyRecord], names: Sequence[str] | None = None
) -> GreedyReport:
    """Exact match of output_ids per record (same prompt_ids required; `names` gates an explicit subset)."""
    pairs, coverage = match_records(
        engine, golden, what="greedy golden", ids=lambda r: r.prompt_ids, ids_label="prompt_ids", names=names
    )
    report = GreedyReport(coverage=coverage)
    for e, g in pairs:
        report.records += 1
        report.tokens += len(g.output_ids)
        d = first_difference(e.output_ids, g.output_ids)
        if d is None:
            report.identical += 1
            continue
        lo = max(0, d - CONTEXT)
        report.mismatches.append(
            GreedyMismatch(
                g.name,
                d,
                len(e.output_ids),
                len(g.output_ids),
                lo,
                list(e.output_ids[lo : d + CONTEXT + 1]),
                list(g.output_ids[lo : d + CONTEXT + 1]),
            )
        )
    return report
