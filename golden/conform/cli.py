"""`python -m golden conform --url URL --model NAME --pair DIR [...]`: gate a running server.

    python -m golden conform --url http://127.0.0.1:8000 --model tiny-trained --pair golden/data/tiny-trained
        [--baseline-url URL] [--tol bf16|fp32] [--tau-tol 0.1] [--prompts N] [--hf-model DIR]
        [--tokenizer FILE] [--server auto|refengine|vllm|sglang] [--checks topk,greedy,...] [--api-key KEY]
        [--sampling-temperature 1.0] [--sampling-top-p 1.0] [--sampling-top-k 0] [--sampling-max-tokens 128]
        [--sampling-seed 0] [--sampling-concurrency 16] [--sampling-ignore-eos]

Prints one line per check (PASS / FAIL / SKIP with its reason / REPORT), the numbers of failures, then one
JSON object as the last line. Exit code: 0 no check failed, 1 a check failed, 2 usage error or input that
cannot be gated (no golden, no scorer, server unreachable before any check).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from golden.conform.checks import (
    FAIL,
    Context,
    check_acceptance,
    check_baseline,
    check_concurrency,
    check_greedy,
    check_topk,
    guarded,
)
from golden.conform.client import Server
from golden.conform.parse import TokenMap
from golden.conform.prom import server_kind
from golden.conform.sampling import DEFAULT_CONCURRENCY, DEFAULT_MAX_TOKENS, SamplingPlan, check_sampling
from golden.conform.source import load_source
from golden.distribution.processing import SamplingConfig
from golden.errors import GoldenError
from golden.gates import BF16, FP32

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
CHECK_NAMES = ("topk", "greedy", "concurrency", "baseline", "acceptance", "sampling")
TAU_REL_TOL = 0.10  # relative; see docs/GOLDEN.md "Gate your engine's server in CI"


def add_conform_parser(sub) -> None:
    p = sub.add_parser("conform", help="run the golden gates against an OpenAI-compatible server")
    p.add_argument("--url", required=True, help="the server under test, http://host:port")
    p.add_argument("--model", required=True, help="the model name it serves")
    p.add_argument("--pair", required=True, type=Path, help="golden/data/<pair> or the HF checkpoint it runs")
    p.add_argument("--baseline-url", help="the same model with speculation off: spec on == spec off check")
    p.add_argument("--tol", choices=["bf16", "fp32"], default="bf16", help="hf gate tolerances (default bf16)")
    p.add_argument("--tau-tol", type=float, default=TAU_REL_TOL, help=f"relative tau band (default {TAU_REL_TOL})")
    p.add_argument("--prompts", type=int, help="only the first N golden prompts")
    p.add_argument("--hf-model", type=Path, help="HF checkpoint that scores divergences")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json mapping token strings to ids")
    p.add_argument("--server", choices=["auto", "refengine", "vllm", "sglang"], default="auto")
    p.add_argument("--checks", default=",".join(CHECK_NAMES), help="comma-separated subset of " + ",".join(CHECK_NAMES))
    p.add_argument("--scorer-dtype", default="float32", help="HF scorer dtype (default float32)")
    p.add_argument("--scorer-device", default="cpu", help="HF scorer device (default cpu)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    s = p.add_argument_group("sampling check", "seeded sampled completions gated by the distribution gate")
    # top-p / top-k off by default: a bf16 server may keep a token on the filter boundary that the fp32 oracle
    # cuts, which reads as impossible (docs/GOLDEN.md, "The distribution gate")
    s.add_argument("--sampling-temperature", type=float, default=1.0, help="temperature (default 1.0)")
    s.add_argument("--sampling-top-p", type=float, default=1.0, help="top_p (default 1.0: off)")
    s.add_argument("--sampling-top-k", type=int, default=0, help="top_k (default 0: off; sent only when on)")
    s.add_argument(
        "--sampling-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help=f"per request ({DEFAULT_MAX_TOKENS})"
    )
    s.add_argument("--sampling-seed", type=int, default=0, help="request i is seeded this + i (default 0)")
    s.add_argument(
        "--sampling-concurrency", type=int, default=DEFAULT_CONCURRENCY, help=f"in flight ({DEFAULT_CONCURRENCY})"
    )
    s.add_argument("--sampling-ignore-eos", action="store_true", help="send ignore_eos: answers run to max_tokens")


def run_conform(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    try:
        chosen = [c.strip() for c in args.checks.split(",") if c.strip()]
        unknown = sorted(set(chosen) - set(CHECK_NAMES))
        if unknown or not chosen:
            raise GoldenError(f"--checks: unknown {unknown} (known: {', '.join(CHECK_NAMES)})")
        if not args.tau_tol > 0:
            raise GoldenError(f"--tau-tol must be positive, got {args.tau_tol}")
        plan = SamplingPlan(
            SamplingConfig(args.sampling_temperature, args.sampling_top_k, args.sampling_top_p),
            args.sampling_max_tokens,
            args.sampling_concurrency,
            args.sampling_seed,
            args.sampling_ignore_eos,
        )
        server = Server(args.url, args.model, args.timeout, args.api_key)
        baseline = Server(args.baseline_url, args.model, args.timeout, args.api_key) if args.baseline_url else None
        src = load_source(args.pair, args.hf_model, args.tokenizer, args.prompts, args.scorer_dtype, args.scorer_device)
        kind = args.server if args.server != "auto" else server_kind(server.metrics())
    except (GoldenError, OSError) as e:
        print(f"golden conform: {type(e).__name__}: {e}", file=out)
        print(json.dumps({"check": "conform", "result": "error", "exit_code": EXIT_USAGE, "message": str(e)}), file=out)
        return EXIT_USAGE
    ctx = Context(server, kind, src, TokenMap.from_tokenizer(src.tokenizer))
    tol = FP32 if args.tol == "fp32" else BF16
    runs = {
        "topk": lambda: check_topk(ctx, tol),
        "greedy": lambda: check_greedy(ctx),
        "concurrency": lambda: check_concurrency(ctx),
        "baseline": lambda: check_baseline(ctx, baseline),
        "acceptance": lambda: check_acceptance(ctx, args.tau_tol),
        "sampling": lambda: check_sampling(server, src, plan),
    }
    print(
        f"golden conform: {args.url} ({kind} server, model {args.model}) vs pair {src.pair}: "
        f"{len(src.greedy)} prompts, tol {args.tol}, regret band {ctx.margin}",
        file=out,
    )
    results = []
    for name in CHECK_NAMES:
        if name in chosen:
            res = guarded(name, ctx, runs[name])
            results.append(res)
            print(res, file=out, flush=True)
    failed = [r.name for r in results if r.status == FAIL]
    code = EXIT_FAIL if failed else EXIT_PASS
    print(f"golden conform: {'FAIL: ' + ', '.join(failed) if failed else 'PASS'}", file=out)
    summary = {
        "check": "conform",
        "result": "fail" if failed else "pass",
        "exit_code": code,
        "server": kind,
        "pair": src.pair,
        "chosen": [name for name in CHECK_NAMES if name in chosen],  # --checks: the ones asked for
        "checks": {r.name: {"status": r.status, "summary": r.summary, **r.data} for r in results},
    }
    print(json.dumps(summary, separators=(",", ":")), file=out)
    return code


def main(argv: Sequence[str] | None = None, out=None) -> int:
    from golden.cli import UsageError, _Parser  # argparse errors end with a JSON line too, as `check`'s do

    out = out or sys.stdout
    ap = _Parser(prog="python -m golden")
    add_conform_parser(ap.add_subparsers(dest="command", required=True, parser_class=_Parser))
    try:
        args = ap.parse_args(argv)
    except UsageError as e:
        print(f"golden conform: usage error: {e}", file=out)
        print(json.dumps({"check": "conform", "result": "error", "exit_code": EXIT_USAGE, "message": str(e)}), file=out)
        return EXIT_USAGE
    return run_conform(args, out)


if __name__ == "__main__":
    raise SystemExit(main())
