"""The gate CLI: gate another engine's JSONL records against stored goldens, from any CI.

    python -m golden check topk       --engine E.jsonl --golden golden/data/<pair> [--tol bf16|fp32 | --fp32]
    python -m golden check greedy     --engine E.jsonl --golden golden/data/<pair>
    python -m golden check acceptance --engine E.jsonl --golden golden/data/<pair> [--margin-tol X]
    python -m golden check distribution --engine S.jsonl --golden C.jsonl [--alpha A] [--min-positions N]
    python -m golden conform --url URL --model NAME --pair DIR [...]   (golden/conform/cli.py)
    (any check: --names a,b,c gates only that explicit subset of the golden records)

`--golden` is a pair's data directory (the check reads topk.jsonl.gz / greedy.jsonl / acceptance.jsonl /
distribution.jsonl in it) or a records file. Prints a short human summary, then one JSON object as the last
line. Exit code: 0 pass, 1 fail, 2 usage error or input that cannot be gated (a missing or malformed file,
or a coverage error: no records, some missing, a name twice, unknown names, other input ids, k < 8, fewer
sampled positions than the distribution gate needs).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

from golden.acceptance import acceptance_gate
from golden.distribution.gate import PIT_SEED, distribution_gate
from golden.distribution.records import read_conditionals_jsonl, read_samples_jsonl
from golden.distribution.stats import ALPHA, ks_sample_size
from golden.errors import GoldenError
from golden.gates import BF16, DRAFT_MARGIN_TOL, FP32, Tolerances, hf_gate
from golden.greedy_gate import greedy_gate
from golden.records import read_acceptance_jsonl, read_greedy_jsonl, read_topk_jsonl

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
TOLERANCES_BY_NAME: dict[str, Tolerances] = {"bf16": BF16, "fp32": FP32}
GOLDEN_FILES = {
    "topk": "topk.jsonl.gz",
    "greedy": "greedy.jsonl",
    "acceptance": "acceptance.jsonl",
    "distribution": "distribution.jsonl",
}
LISTED = 20  # violations / mismatches listed in the JSON line


class UsageError(Exception):
    """Bad command line (argparse's own errors are routed here so they also end with a JSON line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would print usage and sys.exit(2) with no JSON
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m golden", description="Gate an engine's records against the stored goldens.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = sub.add_parser("check", help="run one gate")
    kinds = check.add_subparsers(dest="kind", required=True, parser_class=_Parser)
    for kind, helptext in (
        ("topk", "teacher-forced top-k vs HF (hf_gate)"),
        ("greedy", "greedy outputs vs HF greedy, exact"),
        ("acceptance", "per-step committed lengths vs the oracle's"),
        ("distribution", "sampled continuations vs the oracle's conditionals (PIT: KS + chi-square)"),
    ):
        p = kinds.add_parser(kind, help=helptext)
        p.add_argument("--engine", required=True, type=Path, help="the engine's records (JSONL, .gz ok)")
        p.add_argument("--golden", required=True, type=Path, help="golden/data/<pair> or a records file")
        p.add_argument("--names", default=None, help="comma-separated explicit subset of golden record names")
        if kind == "topk":
            p.add_argument(
                "--tol",
                choices=sorted(TOLERANCES_BY_NAME),
                default="bf16",
                help="tolerance set (default bf16: margin 0.20, head mean 0.06, p99 0.20)",
            )
            p.add_argument("--fp32", action="store_true", help="same as --tol fp32")
        if kind == "acceptance":
            p.add_argument(
                "--margin-tol",
                type=float,
                default=DRAFT_MARGIN_TOL,
                help=f"drafter top-2 near-tie band (default {DRAFT_MARGIN_TOL}, fp32)",
            )
        if kind == "distribution":
            p.add_argument("--alpha", type=float, default=ALPHA, help=f"level of each test (default {ALPHA:g})")
            p.add_argument(
                "--min-positions",
                type=int,
                default=None,
                help="fewer pooled positions is a coverage error (default: ks_sample_size(), 5119 at alpha 1e-3)",
            )
            p.add_argument("--seed", type=int, default=PIT_SEED, help=f"PIT randomization seed (default {PIT_SEED})")
    return ap


def golden_path(kind: str, given: Path) -> Path:
    path = given / GOLDEN_FILES[kind] if given.is_dir() else given
    if not path.is_file():
        raise GoldenError(
            f"no golden {kind} records at {path}"
            + (f" (a pair directory must hold {GOLDEN_FILES[kind]})" if given.is_dir() else "")
        )
    return path


def _names(arg: str | None) -> list[str] | None:
    if arg is None:
        return None
    names = [n.strip() for n in arg.split(",") if n.strip()]
    if not names:
        raise UsageError("--names is empty: give comma-separated record names, or leave it out to gate them all")
    return names


def _check_topk(args) -> tuple[str, bool, dict]:
    tol_name = "fp32" if args.fp32 else args.tol
    tol = TOLERANCES_BY_NAME[tol_name]
    report = hf_gate(
        read_topk_jsonl(args.engine), read_topk_jsonl(golden_path("topk", args.golden)), tol, names=_names(args.names)
    )
    data = {
        "tol": tol_name,
        "margin": tol.margin,
        "head_delta_mean_tol": tol.head_delta_mean,
        "head_delta_p99_tol": tol.head_delta_p99,
        "records": report.coverage.gated if report.coverage is not None else None,
        "positions": report.positions,
        "mean": report.mean,
        "p99": report.p99,
        "max": report.max,
        "max_regret": report.max_regret,
        "missing_from_hf": report.missing_from_hf,
        "violations": len(report.violations),
        "first_violations": [asdict(v) for v in report.violations[:LISTED]],
    }
    return str(report), report.passed, data


def _check_greedy(args) -> tuple[str, bool, dict]:
    report = greedy_gate(
        read_greedy_jsonl(args.engine), read_greedy_jsonl(golden_path("greedy", args.golden)), names=_names(args.names)
    )
    data = {
        "records": report.records,
        "identical": report.identical,
        "tokens": report.tokens,
        "mismatches": len(report.mismatches),
        "first_mismatches": [asdict(m) for m in report.mismatches[:LISTED]],
    }
    return str(report), report.passed, data


def _check_acceptance(args) -> tuple[str, bool, dict]:
    report = acceptance_gate(
        read_acceptance_jsonl(args.engine),
        read_acceptance_jsonl(golden_path("acceptance", args.golden)),
        margin_tol=args.margin_tol,
        names=_names(args.names),
    )
    data = {
        "margin_tol": report.margin_tol,
        "records": report.requests,
        "identical": report.identical,
        "near_ties": len(report.near_ties),
        "failures": len(report.failures),
        "steps_equal": report.steps_compared,
        "golden_steps": report.golden_steps,
        "tau_engine": report.engine_tau,
        "tau_golden": report.golden_tau,
        "first_failures": report.failures[:LISTED],
        "first_near_ties": [asdict(d) for d in report.near_ties[:LISTED]],
    }
    return str(report), report.passed, data


def _check_distribution(args) -> tuple[str, bool, dict]:
    if not 0.0 < args.alpha < 1.0:
        raise UsageError(f"--alpha must be in (0, 1), got {args.alpha}")
    report = distribution_gate(
        read_samples_jsonl(args.engine),
        read_conditionals_jsonl(golden_path("distribution", args.golden)),
        alpha=args.alpha,
        min_positions=args.min_positions,
        names=_names(args.names),
        seed=args.seed,
    )
    u = report.uniformity
    data = {
        "alpha": u.alpha,
        "records": report.coverage.gated if report.coverage is not None else None,
        "positions": u.n,
        "min_positions": report.min_positions,
        "powered_for_kolmogorov_distance": 0.05 if report.min_positions >= ks_sample_size(alpha=u.alpha) else None,
        "ks": u.ks,
        "ks_p": u.ks_p,
        "chi2": u.chi2,
        "chi2_p": u.chi2_p,
        "chi2_counts": u.counts,
        "impossible": len(report.impossible),
        "first_impossible": [asdict(i) for i in report.impossible[:LISTED]],
    }
    return str(report), report.passed, data


CHECKS: dict[str, Callable] = {
    "topk": _check_topk,
    "greedy": _check_greedy,
    "acceptance": _check_acceptance,
    "distribution": _check_distribution,
}


def main(argv: Sequence[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["conform"]:  # golden/conform/cli.py: the gates against a running server
        from golden.conform.cli import main as conform_main

        return conform_main(argv, out)
    kind = None
    try:
        args = build_parser().parse_args(argv)
        kind = args.kind
        summary, passed, data = CHECKS[kind](args)
        code = EXIT_PASS if passed else EXIT_FAIL
        result = {
            "check": kind,
            "result": "pass" if passed else "fail",
            "exit_code": code,
            "engine": str(args.engine),
            "golden": str(args.golden),
            **data,
        }
    except (UsageError, GoldenError) as e:
        code = EXIT_USAGE
        label = "usage error" if isinstance(e, UsageError) else type(e).__name__
        summary = f"golden check {kind or '?'}: {label}: {e}"
        result = {"check": kind, "result": "error", "exit_code": code, "error": type(e).__name__, "message": str(e)}
    print(summary, file=out)
    print(json.dumps(result, separators=(",", ":")), file=out)
    return code
