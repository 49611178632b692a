"""Acceptance gates: an engine's per-step committed lengths against the acceptance goldens, and acceptance at
concurrency N against the same requests run alone.

Losslessness says nothing about acceptance: a drafter fed the wrong features (one layer off, a neighbouring
request's rows) still yields outputs equal to plain greedy, only with different accepted lengths. The
goldens (AcceptanceRecord, made by golden.oracle_dflash in fp32 on CPU) pin every step's committed length.

**acceptance_gate**: per request, the outputs must be equal (acceptance is only comparable on a lossless
run), and every verify step must commit exactly the golden's number of tokens. The one allowed difference
is a genuine near-tie of the drafter: when step i commits c_engine != c_golden tokens, the draft that
decided it is d_{j+1} with j = min(c_engine, c_golden) - 1 (the first draft on which the two drafters
disagreed: all earlier ones were accepted by both); if the golden drafter's top-1 minus top-2 logit there is
<= margin_tol, fp32 reduction order may have flipped that argmax, so the step is reported as a near-tie and
the request's later steps (now at different positions) are not compared. Any other difference fails.

**acceptance_batch_invariance_gate**: tau (committed tokens per verify step) over all requests at
concurrency N must be >= min_fraction x tau of the same requests run alone; optionally per request too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from golden.coverage import Coverage, first_difference, match_records
from golden.errors import GoldenError
from golden.gates import DRAFT_MARGIN_TOL
from golden.records import AcceptanceRecord


def _ctx(xs: Sequence[int], i: int, width: int = 3) -> list[int]:
    return list(xs[max(0, i - width) : i + width + 1])


@dataclass(frozen=True)
class StepDifference:
    name: str
    step: int  # verify step index
    got: int  # tokens the engine committed at that step
    want: int  # tokens the golden committed
    draft_index: int  # 1-based draft d_j that decided the difference
    margin: float | None  # golden drafter top-1 minus top-2 logit at d_j; None when not recorded
    near_tie: bool

    def __str__(self) -> str:
        m = "not recorded" if self.margin is None else f"{self.margin:.6f}"
        kind = "near-tie (allowed)" if self.near_tie else "NOT a near-tie"
        return (
            f"{self.name} step {self.step}: committed {self.got}, golden {self.want}; deciding draft "
            f"d_{self.draft_index}, golden drafter top-2 margin {m}: {kind}"
        )


@dataclass
class AcceptanceReport:
    margin_tol: float
    coverage: Coverage
    requests: int = 0
    identical: int = 0  # requests whose every step matched
    steps_compared: int = 0  # steps compared and equal
    golden_steps: int = 0
    engine_committed: int = 0
    engine_steps: int = 0
    golden_committed: int = 0
    near_ties: list[StepDifference] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def engine_tau(self) -> float:
        return self.engine_committed / self.engine_steps if self.engine_steps else 0.0

    @property
    def golden_tau(self) -> float:
        return self.golden_committed / self.golden_steps if self.golden_steps else 0.0

    def __str__(self) -> str:
        lines = [
            f"acceptance gate {'PASS' if self.passed else 'FAIL'}: {self.requests} requests ({self.coverage}); "
            f"identical {self.identical}, near-ties {len(self.near_ties)} (drafter top-2 margin tol "
            f"{self.margin_tol}), failures {len(self.failures)}; steps equal {self.steps_compared} of "
            f"{self.golden_steps} golden steps; tau engine {self.engine_tau:.4f} vs golden {self.golden_tau:.4f}"
        ]
        lines += [f"  FAIL {f}" for f in self.failures[:20]]
        if len(self.failures) > 20:
            lines.append(f"  ... {len(self.failures) - 20} more failures")
        lines += [f"  near-tie: {d}" for d in self.near_ties[:20]]
        return "\n".join(lines)

    def assert_passes(self) -> None:
        if not self.passed:
            raise AssertionError(str(self))


def acceptance_gate(
    engine: Sequence[AcceptanceRecord],
    golden: Sequence[AcceptanceRecord],
    margin_tol: float = DRAFT_MARGIN_TOL,
    names: Sequence[str] | None = None,
) -> AcceptanceReport:
    """Gate per-step committed lengths against the goldens (module docstring). Coverage is enforced
    (CoverageError); `names` gates an explicit subset."""
    pairs, coverage = match_records(
        engine, golden, what="acceptance golden", ids=lambda r: r.prompt_ids, ids_label="prompt_ids", names=names
    )
    report = AcceptanceReport(margin_tol=margin_tol, coverage=coverage)
    for e, g in pairs:
        report.requests += 1
        report.golden_steps += len(g.accepted_lengths)
        report.golden_committed += sum(g.accepted_lengths)
        report.engine_steps += len(e.accepted_lengths)
        report.engine_committed += sum(e.accepted_lengths)
        d = first_difference(e.output_ids, g.output_ids)
        if d is not None:
            report.failures.append(
                f"{g.name}: output differs from the golden at generated position {d} (lengths "
                f"{len(e.output_ids)} vs {len(g.output_ids)}): got {_ctx(e.output_ids, d)} want "
                f"{_ctx(g.output_ids, d)}; acceptance is only comparable on a lossless run"
            )
            continue
        diff = _first_step_difference(e, g, margin_tol)
        if diff is None:
            report.identical += 1
            report.steps_compared += len(g.accepted_lengths)
            continue
        report.steps_compared += diff.step
        if diff.near_tie:
            report.near_ties.append(diff)
        else:
            report.failures.append(
                f"{diff}; engine steps {_ctx(e.accepted_lengths, diff.step)} golden "
                f"{_ctx(g.accepted_lengths, diff.step)} around step {diff.step}"
            )
    return report


def _first_step_difference(e: AcceptanceRecord, g: AcceptanceRecord, tol: float) -> StepDifference | None:
    # equal outputs and 1 + sum(steps) == len(output) on both sides: equal prefixes imply equal lengths
    for i, (got, want) in enumerate(zip(e.accepted_lengths, g.accepted_lengths)):
        if got == want:
            continue
        j = min(got, want)  # d_j, 1-based: the first draft the two runs judged differently
        row = g.draft_margins[i] if g.draft_margins else []
        margin = row[j - 1] if j - 1 < len(row) else None
        return StepDifference(g.name, i, got, want, j, margin, margin is not None and margin <= tol)
    return None


def truncate_to_budget(rec: AcceptanceRecord, max_tokens: int) -> AcceptanceRecord:
    """The acceptance record the same request gives with a smaller budget.

    The drafter always drafts a full block and a step with r tokens left verifies min(B, r) of them, so
    with budget b every step commits min(c_i, b - generated) tokens and stops at b: exact, no block size
    needed. Budgets above the golden's are not derivable (the golden may have stopped at its own budget)."""
    if not 1 <= max_tokens <= len(rec.output_ids):
        raise GoldenError(
            f"{rec.name}: budget {max_tokens} outside 1..{len(rec.output_ids)} (the golden's "
            f"output length); larger budgets need their own goldens"
        )
    generated, steps, margins = 1, [], []
    for i, c in enumerate(rec.accepted_lengths):
        if generated >= max_tokens:
            break
        left = max_tokens - generated
        steps.append(min(c, left))
        if rec.draft_margins:
            margins.append(rec.draft_margins[i][: left - 1])
        generated += steps[-1]
    return AcceptanceRecord(rec.name, list(rec.prompt_ids), list(rec.output_ids[:max_tokens]), steps, margins)


@dataclass
class BatchInvarianceReport:
    min_fraction: float
    per_request_min_fraction: float | None
    coverage: Coverage
    tau_alone: float = 0.0
    tau_concurrent: float = 0.0
    outputs_differ: int = 0  # informational: bf16 tie flips may change outputs between concurrency levels
    per_request: list[tuple[float, str, float, float]] = field(default_factory=list)  # (ratio, name, alone, conc)
    failures: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.tau_concurrent / self.tau_alone if self.tau_alone else 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        per = "" if self.per_request_min_fraction is None else f", per request >= {self.per_request_min_fraction}"
        lines = [
            f"acceptance batch invariance {'PASS' if self.passed else 'FAIL'}: tau concurrent "
            f"{self.tau_concurrent:.4f} / alone {self.tau_alone:.4f} = {self.ratio:.4f} (min {self.min_fraction}"
            f"{per}); {self.coverage}; outputs differing {self.outputs_differ}"
        ]
        lines += [f"  FAIL {f}" for f in self.failures[:20]]
        lines += [
            f"  worst request {n}: tau alone {a:.3f}, concurrent {c:.3f}, ratio {r:.3f}"
            for r, n, a, c in sorted(self.per_request)[:5]
        ]
        return "\n".join(lines)

    def assert_passes(self) -> None:
        if not self.passed:
            raise AssertionError(str(self))


def acceptance_batch_invariance_gate(
    alone: Sequence[AcceptanceRecord],
    concurrent: Sequence[AcceptanceRecord],
    min_fraction: float,
    per_request_min_fraction: float | None = None,
    names: Sequence[str] | None = None,
) -> BatchInvarianceReport:
    """Acceptance of the same requests run at concurrency N (`concurrent`) vs one at a time (`alone`)."""
    if not 0 < min_fraction <= 1.5:
        raise GoldenError(f"min_fraction {min_fraction} outside (0, 1.5]: a fraction of the alone tau")
    pairs, coverage = match_records(
        concurrent, alone, what="alone-run", ids=lambda r: r.prompt_ids, ids_label="prompt_ids", names=names
    )
    report = BatchInvarianceReport(min_fraction, per_request_min_fraction, coverage)
    steps_a = sum(len(a.accepted_lengths) for _, a in pairs)
    steps_c = sum(len(c.accepted_lengths) for c, _ in pairs)
    if steps_a == 0 or steps_c == 0:
        raise GoldenError(
            f"no verify steps to compare (alone {steps_a}, concurrent {steps_c}): were the requests speculating?"
        )
    report.tau_alone = sum(sum(a.accepted_lengths) for _, a in pairs) / steps_a
    report.tau_concurrent = sum(sum(c.accepted_lengths) for c, _ in pairs) / steps_c
    for c, a in pairs:
        report.outputs_differ += c.output_ids != a.output_ids
        if a.accepted_lengths and c.accepted_lengths:
            report.per_request.append((c.tau / a.tau, a.name, a.tau, c.tau))
    if report.ratio < min_fraction:
        report.failures.append(
            f"tau at concurrency {report.tau_concurrent:.4f} is {report.ratio:.4f} of tau "
            f"alone {report.tau_alone:.4f} < {min_fraction}"
        )
    if per_request_min_fraction is not None:
        report.failures += [
            f"{n}: tau alone {ta:.3f}, concurrent {tc:.3f}, ratio {r:.3f} < {per_request_min_fraction}"
            for r, n, ta, tc in report.per_request
            if r < per_request_min_fraction
        ]
    return report
