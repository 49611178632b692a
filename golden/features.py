"""Direct feature checks: the target features an engine hands its DFlash drafter against HF's, row by row.

tau is a blunt detector of wrong drafter features: features one layer off or taken from a neighbouring
request leave it almost unchanged. So compare the features themselves: row p of a request's drafter
context must equal golden.hf_reference.target_features(target, ids[:n], tap_layers)[p] (the outputs of
the tap layers for that request's own tokens, before the final norm), whichever plan produced it: a
prefill alone, a batched prefill, or a verify commit. fp32, tolerance FEATURE_REL_TOL (golden/gates.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from golden.gates import FEATURE_REL_TOL


@dataclass
class FeatureReport:
    name: str
    rows: int  # rows compared
    rel_tol: float
    max_abs: float = 0.0  # max |engine - HF| over every compared value
    max_rel: float = 0.0  # max over rows of (max |delta| in the row) / (max |HF| in the row)
    bad_rows: int = 0
    first_bad_row: int | None = None  # the position of the first row over tolerance
    first_bad_rel: float = 0.0
    first_bad_label: str = ""  # where that row came from (the caller's label, e.g. the plan that produced it)
    row_count: tuple[int, int] | None = None  # (engine rows, expected rows) when they differ

    @property
    def passed(self) -> bool:
        return self.bad_rows == 0 and self.row_count is None

    def __str__(self) -> str:
        head = (
            f"features {self.name} {'PASS' if self.passed else 'FAIL'}: {self.rows} rows, max |delta| "
            f"{self.max_abs:.3e}, max row-relative {self.max_rel:.3e} (tol {self.rel_tol})"
        )
        if self.row_count is not None:
            head += f"; engine handed over {self.row_count[0]} rows, expected {self.row_count[1]}"
        if self.first_bad_row is not None:
            head += (
                f"; {self.bad_rows} rows over tolerance, first at position {self.first_bad_row} "
                f"(row-relative {self.first_bad_rel:.3e}, from {self.first_bad_label or 'unlabelled'})"
            )
        return head

    def assert_passes(self) -> None:
        if not self.passed:
            raise AssertionError(str(self))


def feature_check(
    name: str,
    engine_rows: torch.Tensor,
    hf_rows: torch.Tensor,
    expected_rows: int | None = None,
    labels: Sequence[str] | None = None,
    rel_tol: float = FEATURE_REL_TOL,
) -> FeatureReport:
    """engine_rows [n, F*H] (positions 0..n-1) against hf_rows [>= n, F*H] (HF target_features of the same
    request's tokens). expected_rows: how many rows the engine should have handed over (e.g. the committed
    length); labels[p]: where row p came from, printed for the first bad row."""
    if engine_rows.dim() != 2 or hf_rows.dim() != 2 or engine_rows.shape[1] != hf_rows.shape[1]:
        raise ValueError(f"{name}: feature shapes {list(engine_rows.shape)} vs {list(hf_rows.shape)}")
    n = min(engine_rows.shape[0], hf_rows.shape[0])
    report = FeatureReport(name=name, rows=n, rel_tol=rel_tol)
    if expected_rows is not None and engine_rows.shape[0] != expected_rows:
        report.row_count = (engine_rows.shape[0], expected_rows)
    if n == 0:
        return report
    got, want = engine_rows[:n].float(), hf_rows[:n].float()
    delta = (got - want).abs().amax(-1)  # [n]
    rel = delta / want.abs().amax(-1).clamp_min(1e-30)  # [n]
    bad = (rel > rel_tol).nonzero().flatten().tolist()
    report.max_abs, report.max_rel, report.bad_rows = float(delta.max()), float(rel.max()), len(bad)
    if bad:
        report.first_bad_row, report.first_bad_rel = bad[0], float(rel[bad[0]])
        report.first_bad_label = labels[bad[0]] if labels is not None and bad[0] < len(labels) else ""
    return report
