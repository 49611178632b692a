"""The gates: an engine's records against HF's (hf_gate), and spec-on against spec-off (regret gate).

Both gates measure in nats of logprob. A *regret* is how much worse the picked token is than the best one
under the reference distribution: regret(pick) = logprob(top1) - logprob(pick) >= 0. A genuine tie flip
(bf16 reduction order picking the other of two near-equal tokens) has regret ~0; the bug classes that
matter (KV misalignment, a mask leak, a wrong RoPE position) land far outside MARGIN_TOL.

A pick missing from the reference top-k has an unknown logprob, at most the k-th logprob, so its regret is
at least top1 - kth: the gates use that *lower bound* and mark the violation `in_topk=False`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from golden.coverage import Coverage, match_records
from golden.errors import CoverageError
from golden.records import TopKRecord

MARGIN_TOL = 0.20  # nat; the upstream bf16 tie band (pegainfer hf_golden_gate)
HEAD_TOP_N = 8  # head deltas are taken over the engine's top-8 tokens


@dataclass(frozen=True)
class Tolerances:
    margin: float  # max regret of the engine's argmax under HF, nat
    head_delta_mean: float  # max mean |engine lp - HF lp| over the engine's top-8, nat
    head_delta_p99: float  # max 99th percentile of the same
    note: str = ""  # where the numbers come from


BF16 = Tolerances(margin=MARGIN_TOL, head_delta_mean=0.06, head_delta_p99=0.20, note="upstream bf16 GPU figures")

# fp32 on CPU differs from HF fp32 only by reduction order. Calibrated 2026-11-29 (torch 2.13.0 CPU,
# transformers 5.24.0) on tiny-random, 48 sequences / 6417 teacher-forced positions, bs=1 and all 48 in one
# batch: head delta mean 2e-6, p99 7e-6, max 1.4e-5; argmax regret 0 (no flip). Procedure: each tolerance
# is 10x the observed figure rounded up to a power of ten (mean 1e-5 -> 1e-4 kept with headroom for other
# pairs, p99 7e-5 -> 1e-4); the margin stays 1e-3 so an exact fp32 tie may still flip. The broken-model
# tests (query RoPE +1, K/V one slot late) read mean 0.4-2.1 and max regret > 1: five orders above these.
FP32 = Tolerances(
    margin=1e-3,
    head_delta_mean=1e-4,
    head_delta_p99=1e-4,
    note="fp32 CPU, calibrated 2026-11-29: observed mean 2e-6, p99 7e-6, max 1.4e-5, regret 0",
)

# The acceptance gate's near-tie band (golden/acceptance.py): a verify step may commit a different number of
# tokens than the acceptance golden only where the golden drafter's top-1 minus top-2 logit at the deciding
# draft is <= this. Calibrated 2026-12-01 (torch 2.13.0 CPU, transformers 5.24.0) on tiny-trained: refengine's
# batched drafter fed refengine's own target features vs golden's dense oracle fed HF features, at every one
# of the 829 propose calls of the 55 golden prompts (budget 24), bs=1 and all 55 in one batch: max |logit
# delta| 5.7e-5 (both), max change of the oracle's top-2 margin 3.2e-5. A margin moves by at most twice the
# logit delta (1.2e-4); the band is 10x the logit delta rounded up to a power of ten. fp32 only: bf16 runs
# are gated by tau tolerances (tests/gpu), not by per-step equality.
DRAFT_MARGIN_TOL = 1e-3  # logit (= logprob) units

# Direct feature checks (golden/features.py): the target features an engine hands its drafter against HF's
# tap-layer outputs, row by row: max |delta| over a row <= FEATURE_REL_TOL x max |HF value| of that row. fp32
# only. Calibrated 2026-12-01 on refengine CPU fp32 (torch 2.13.0, transformers 5.24.0), tiny-trained and
# tiny-random, 14 requests (a prefill alone, a batched prefill of 6, verify commits at batch 7), 700 rows:
# observed max relative 2.8e-6 (absolute 1.4e-5 on rows up to |21|); 10x rounded up to a power of ten.
# The deliberately broken engines (tap layer + 1, a neighbour's rows, verify rows shifted) read 0.1-2.
FEATURE_REL_TOL = 1e-4
# The same check in bf16 on the GPU (tests/gpu: the feature store written inside the CUDA graphs, and by the
# eager prefill, against HF's bf16 forward on the same tokens). Calibrated 2026-12-02 on the H200 (torch 2.11
# +cu130, FlashInfer 0.6.3), tiny-trained, adaptive with two plain steps per draft, piecewise and full graphs:
# 662 rows, observed max row-relative 2.45e-2 (both modes alike: bf16 rounding, a few ulps of the row's
# largest value), worst on prefill rows; 2x rounded. Rotated decode rows read 0.19-1.7 (CPU fp32).
FEATURE_REL_TOL_BF16 = 5e-2

# Keyed by dtype name, so golden.gates (and the gate CLI) import without torch.
TOLERANCES: dict[str, Tolerances] = {"bfloat16": BF16, "float32": FP32}


def tolerances_for(dtype) -> Tolerances:
    """The tolerances for a torch dtype or a dtype name ("bfloat16", "float32")."""
    name = str(dtype).removeprefix("torch.")
    if name not in TOLERANCES:
        raise ValueError(f"no golden tolerances for {name}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[name]


class TopKLike(Protocol):
    topk_ids: list[list[int]]  # [n][k]
    topk_logprobs: list[list[float]]  # [n][k], descending


@dataclass(frozen=True)
class Violation:
    name: str
    position: int  # hf_gate: teacher-forced row; regret gate: index into the generated tokens
    pick: int  # the engine's (or spec's) token
    top1: int  # the reference argmax
    regret: float  # nat; a lower bound when not in_topk
    in_topk: bool

    def __str__(self) -> str:
        bound = "" if self.in_topk else " (pick outside reference top-k: lower bound)"
        return f"{self.name} pos {self.position}: pick {self.pick} vs top1 {self.top1}, regret {self.regret:.4f}{bound}"


def _regret(ref_ids: Sequence[int], ref_lps: Sequence[float], pick: int) -> tuple[float, bool]:
    """(regret of `pick` under one reference row, whether pick is in its top-k)."""
    if pick in ref_ids:
        return ref_lps[0] - ref_lps[ref_ids.index(pick)], True
    return ref_lps[0] - ref_lps[-1], False


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation): the smallest value >= q% of the values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class GateReport:
    tol: Tolerances
    positions: int = 0
    mean: float = 0.0  # head delta, nat
    p99: float = 0.0
    max: float = 0.0
    max_regret: float = 0.0  # largest argmax regret seen (passing or not)
    worst: list[tuple[float, str, int, int]] = field(default_factory=list)  # (delta, name, pos, token)
    missing_from_hf: int = 0  # engine head tokens absent from HF's top-k (delta taken vs HF's k-th)
    violations: list[Violation] = field(default_factory=list)
    coverage: Coverage | None = None

    @property
    def passed(self) -> bool:
        return not self.violations and self.mean <= self.tol.head_delta_mean and self.p99 <= self.tol.head_delta_p99

    def __str__(self) -> str:
        t = self.tol
        lines = [
            f"hf_gate {'PASS' if self.passed else 'FAIL'}: {self.positions} positions; "
            f"head delta (engine top-{HEAD_TOP_N}) mean {self.mean:.6f} (tol {t.head_delta_mean}), "
            f"p99 {self.p99:.6f} (tol {t.head_delta_p99}), max {self.max:.6f}; "
            f"max argmax regret {self.max_regret:.6f} (margin {t.margin}); "
            f"head tokens missing from HF top-k: {self.missing_from_hf}; "
            f"violations: {len(self.violations)}  [{t.note}]"
        ]
        if self.coverage is not None:
            lines.append(f"  coverage: {self.coverage}")
        lines += [f"  violation: {v}" for v in self.violations[:20]]
        if len(self.violations) > 20:
            lines.append(f"  ... {len(self.violations) - 20} more violations")
        lines += [f"  worst delta {d:.6f} at {n} pos {p} token {tok}" for d, n, p, tok in self.worst]
        return "\n".join(lines)

    def assert_passes(self) -> None:
        if not self.passed:
            raise AssertionError(str(self))


def hf_gate(
    engine: Sequence[TopKRecord],
    hf: Sequence[TopKRecord],
    tol: Tolerances = BF16,
    worst_n: int = 5,
    names: Sequence[str] | None = None,
) -> GateReport:
    """Gate teacher-forced engine records against HF records of the same names and token ids.

    Coverage is enforced (golden/coverage.py): the engine must write one record, with k >= 8, for every HF
    record, or for exactly the explicit subset `names`; otherwise CoverageError says what is missing.
    Per position: the engine's argmax must be in HF's top-k with regret <= tol.margin. Head deltas are
    |engine lp - HF lp| over the engine's top-8 tokens; a token outside HF's top-k is scored against
    HF's k-th logprob (its true HF logprob is at most that, so when the engine rates it higher this
    under-states the true delta: such tokens are counted in `missing_from_hf` so a reader sees them).
    """
    pairs, coverage = match_records(
        engine, hf, what="HF", ids=lambda r: r.token_ids, ids_label="token_ids", names=names
    )
    narrow = [f"{e.name} (k={e.k})" for e, _ in pairs if e.k < HEAD_TOP_N]
    if narrow:
        raise CoverageError(
            f"engine records need k >= {HEAD_TOP_N} top tokens per row for the head deltas; "
            f"{len(narrow)} have fewer: {', '.join(narrow[:8])}"
        )
    report = GateReport(tol=tol, coverage=coverage)
    deltas: list[Delta] = []
    for rec, ref in pairs:
        for p in range(len(rec.token_ids)):
            e_ids = rec.topk_ids[p]
            gate_position(report, deltas, rec.name, p, ref, [e_ids[0]], e_ids, rec.topk_logprobs[p])
    finish_head_deltas(report, deltas, worst_n)
    return report


Delta = tuple[float, str, int, int]  # (|engine lp - HF lp|, record name, position, token)


def gate_position(
    report: GateReport,
    deltas: list[Delta],
    name: str,
    p: int,
    ref: TopKRecord,
    argmax: Sequence[int],
    e_ids: Sequence[int],
    e_lps: Sequence[float],
) -> None:
    """hf_gate at one position: the engine's argmax (when ambiguous, its best candidate: a lower bound on its
    regret) against HF's row within the margin, and the head deltas of its top-8 entries (a token outside HF's
    top-k scored against HF's k-th logprob, counted in missing_from_hf)."""
    h_ids, h_lps = ref.topk_ids[p], ref.topk_logprobs[p]
    regret, in_topk, pick = min((*_regret(h_ids, h_lps, c), c) for c in argmax)
    report.max_regret = max(report.max_regret, regret)
    if not in_topk or regret > report.tol.margin:
        report.violations.append(Violation(name, p, pick, h_ids[0], regret, in_topk))
    for tok, e_lp in zip(e_ids[:HEAD_TOP_N], e_lps[:HEAD_TOP_N]):
        h_lp = ref.logprob_of(p, tok)
        if h_lp is None:
            report.missing_from_hf += 1
            h_lp = h_lps[-1]
        deltas.append((abs(e_lp - h_lp), name, p, tok))
    report.positions += 1


def finish_head_deltas(report: GateReport, deltas: list[Delta], worst_n: int) -> None:
    """The head deltas' mean, p99, max and worst entries into the report."""
    values = [d[0] for d in deltas]
    if values:
        report.mean = sum(values) / len(values)
        report.p99 = _percentile(values, 99)
        report.max = max(values)
        report.worst = sorted(deltas, key=lambda d: -d[0])[:worst_n]


@dataclass
class RegretReport:
    name: str
    tol: float
    reanchor: bool
    first_divergence: int | None = None  # index into the generated tokens; None: spec == baseline
    first_regret: float = 0.0
    gated: int = 0  # generated positions whose pick was regret-checked
    tie_flips: int = 0  # gated picks that are not the reference argmax but within tol
    max_regret: float = 0.0
    length_mismatch: tuple[int, int] | None = None  # (baseline, spec) lengths with no divergent token
    violations: list[Violation] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations and self.length_mismatch is None

    def __str__(self) -> str:
        where = "none (identical)" if self.first_divergence is None else str(self.first_divergence)
        lines = [
            f"regret gate {self.name} {'PASS' if self.passed else 'FAIL'}: first divergence {where}, "
            f"regret {self.first_regret:.6f} (tol {self.tol}); reanchor {self.reanchor}: gated "
            f"{self.gated} positions, tie flips {self.tie_flips}, max regret {self.max_regret:.6f}, "
            f"violations {len(self.violations)}"
        ]
        if self.length_mismatch is not None:
            lines.append(
                f"  same tokens but different lengths: baseline {self.length_mismatch[0]}, "
                f"spec {self.length_mismatch[1]}"
            )
        lines += [f"  violation: {v}" for v in self.violations[:20]]
        return "\n".join(lines)

    def assert_passes(self) -> None:
        if not self.passed:
            raise AssertionError(str(self))


def first_divergence_regret_gate(
    prompt_ids: Sequence[int],
    baseline_ids: Sequence[int],
    spec_ids: Sequence[int],
    score_fn: Callable[[list[int]], TopKLike],
    tol: float = MARGIN_TOL,
    reanchor: bool = True,
    name: str = "",
) -> RegretReport:
    """Gate spec-on output against spec-off at their first divergence (and, with reanchor, after it).

    baseline_ids / spec_ids are the generated tokens (no prompt). score_fn(ids) returns top-k rows for
    every position of ids (teacher forcing); it is called once, on prompt + spec_ids, which gives the
    re-prefilled distribution after every spec prefix at once. The spec pick at generated index j is
    scored by row len(prompt) + j - 1. Upstream gates only the first divergence; reanchor=True continues
    from the spec pick and gates every later spec token the same way, up to the end.
    """
    if not prompt_ids:
        raise ValueError("empty prompt: the first generated token has no scoring row")
    report = RegretReport(name=name, tol=tol, reanchor=reanchor)
    first = next((j for j, (b, s) in enumerate(zip(baseline_ids, spec_ids)) if b != s), None)
    if first is None:
        if len(baseline_ids) != len(spec_ids):
            report.length_mismatch = (len(baseline_ids), len(spec_ids))
        return report
    report.first_divergence = first
    ids = list(prompt_ids) + list(spec_ids)
    scores = score_fn(ids)
    if len(scores.topk_ids) < len(ids) - 1:
        raise ValueError(f"score_fn gave {len(scores.topk_ids)} rows for {len(ids)} ids")
    last = len(spec_ids) if reanchor else first + 1
    for j in range(first, last):
        row = len(prompt_ids) + j - 1
        ref_ids, ref_lps = scores.topk_ids[row], scores.topk_logprobs[row]
        regret, in_topk = _regret(ref_ids, ref_lps, spec_ids[j])
        if j == first:
            report.first_regret = regret
        report.gated += 1
        report.max_regret = max(report.max_regret, regret)
        if regret > tol:  # outside the top-k, regret is a lower bound: a violation only if it exceeds tol
            report.violations.append(Violation(name, j, spec_ids[j], ref_ids[0], regret, in_topk))
        elif spec_ids[j] != ref_ids[0]:
            report.tie_flips += 1
    return report
