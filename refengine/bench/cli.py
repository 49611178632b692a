"""`refengine bench`: throughput and per-step timings, plain vs DFlash vs adaptive (and HF as a peer), with the
memory-bound floor; or, with --sample-cells, a seeded random sample of the cell matrix judged against a bar.
A table on stderr, tqdm progress on stderr, the JSON as the last line of stdout.

    refengine bench --concurrency 1,8 --prompts mixed                 # embedded trained tiny pair
    refengine bench --target fixtures/configs/qwen3-4b --draft fixtures/configs/qwen3-4b-dflash-b16 \\
        --synthetic --acceptance-profile tau1,tau3,tau6.5 --peer hf --plot perf.png --output perf.json
    refengine bench --sample-cells 12                                 # a fresh seed, printed and in the JSON
    refengine bench --sample-cells 2 --seed 1 --pairs tiny            # the tiny pair's cells alone (CPU)

Rows (no --sample-cells): greedy, ignore_eos. One engine at a time, on CUDA each mode in a fresh process
(suite.py); --processes N repeats that N rounds, the modes taking turns, against the noise between processes.
--paired runs every mode against plain in one process, run by run, with a second plain engine as the control
(paired.py). --acceptance-profile NAME[,NAME] (benchmark-only: refengine.spec_decode.acceptance_profile) draws
the accepted drafts per step from a named profile: those rows say `acceptance: profile <name>`, their outputs
are not greedy-exact. Without it DFlash rows are labelled 'real drafter' or 'chance (synthetic weights)'.
Column definitions: refengine/bench/run.py and docs/PERF.md.

Cell matrix (--sample-cells N, cells.py, matrix.py, verdict.py): N distinct cells of the matrix (Qwen3-4B
shapes under five acceptance profiles and the trained tiny pair on four prompt sets; c 1, 8, 16, 32, 64; wave
and steady arrivals; settle 0 or 15 s) in random order, drawn with --seed (default: a fresh one); each cell
measured for plain, dflash and adaptive in the same run and judged by adaptive / max(plain, dflash) against
--bar; the JSON names the worst cell and whether the bar holds. Run it with fresh seeds at least twice and
take the worst cell over the runs.

Exit status 2 with a message when any request is rejected, a row runs no tokens or a span policy's choice
raised.
"""

from __future__ import annotations

import argparse
import json

import torch

from refengine.bench.cells import PAIRS
from refengine.bench.floors import measure_copy_bandwidth
from refengine.bench.matrix_cli import CELL_TOKENS, cmd_matrix
from refengine.bench.prefix import WORKLOADS, cmd_workload
from refengine.bench.prompts import PROMPT_SETS
from refengine.bench.report import KEY, print_table
from refengine.bench.run import BenchError
from refengine.bench.suite import MODES, bench
from refengine.bench.verdict import DEFAULT_BAR
from refengine.config import DRAFT_SAMPLINGS
from refengine.defaults import add_fused_ops_argument, add_prefix_caching_argument
from refengine.spec_decode.acceptance_profile import parse_profile


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise BenchError(f"{what} {text!r}: give positive integers, comma-separated (e.g. 1,8,16,32)")
    return vals


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="throughput and step timings, plain vs DFlash vs adaptive (JSON last line); --sample-cells: the matrix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", help="target checkpoint dir or config dir (default: embedded tiny pair)")
    p.add_argument("--draft", help="drafter dir (default with no --target: the embedded drafter)")
    p.add_argument("--synthetic", action="store_true", help="random weights from config.json alone")
    p.add_argument("--device", default=None)
    p.add_argument("--concurrency", default="1,8,16,32", help="comma-separated, e.g. 1,8,16,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--output-tokens",
        type=int,
        default=None,
        help=f"new tokens a request (default 128; --sample-cells: {CELL_TOKENS})",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measured runs per row (median, min-max reported); --sample-cells: rounds per cell before pairing",
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated subset of {','.join(MODES)} (default: all; dflash is speculation=fixed)",
    )
    p.add_argument(
        "--speculation",
        choices=["fixed", "adaptive"],
        default=None,
        help="measure plain and this span policy only (--modes plain,dflash or plain,adaptive)",
    )
    p.add_argument(
        "--acceptance-profile",
        default=None,
        help="benchmark-only: tau<T>, geom<p>, sharegpt, gsm8k, humaneval (comma-separated for several)",
    )
    p.add_argument(
        "--prompts",
        choices=PROMPT_SETS,
        default="random",
        help="random token ids, or the trained tiny pair's bundled code / prose / chat prompts",
    )
    p.add_argument(
        "--settle-s", type=float, default=None, help="seconds of untimed load before each mode's runs (CUDA: 15)"
    )
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each mode in a fresh process (default: on CUDA; --no-isolate: all in this process; docs/PERF.md); "
        "--sample-cells: each pair's engines in a fresh process",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="rounds of fresh processes per mode, modes taking turns (needs --isolate, the CUDA default)",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="every mode against plain in one process, run by run, with a second plain engine as the control "
        "(refengine/bench/paired.py; the resolution for ratios near 1); rounds in a balanced order: --repeats a "
        "multiple of the engines' count (twice it when odd) balances each row",
    )
    p.add_argument(
        "--own-weights",
        action="store_true",
        help="--paired: each engine loads its own copy of the target's weights (default: one copy, shared)",
    )
    p.add_argument(
        "--arrivals",
        choices=["wave", "steady"],
        default="wave",
        help="wave: a cell's c requests submitted together, run to the last; steady: 4 x c requests, c in flight, "
        "the next submitted as one finishes (a server at constant concurrency; engine rows only)",
    )
    p.add_argument("--peer", choices=["hf"], default=None, help="also measure HF transformers generate")
    p.add_argument("--peer-compile", action="store_true", help="HF peer with static cache + torch.compile")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="engine context cap (default prompt-len + output-tokens + 16)"
    )
    p.add_argument(
        "--graph-mode",
        choices=["eager", "piecewise", "full"],
        default=None,
        help="CUDA graphs for decode / verify / draft (default: full on CUDA, eager on the CPU)",
    )
    add_fused_ops_argument(p)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompts and acceptance draws (default 0); --sample-cells: also the sample (default: a fresh one)",
    )
    p.add_argument(
        "--sample-cells",
        type=int,
        default=None,
        metavar="N",
        help="measure N random cells of the cell matrix (refengine/bench/cells.py) for plain, dflash and adaptive "
        "in one run, and judge adaptive / max(plain, dflash) against --bar (refengine/bench/matrix.py)",
    )
    p.add_argument(
        "--pairs",
        default=None,
        help=f"--sample-cells: draw from these pairs' cells only, a subset of {','.join(PAIRS)} (default: both; "
        "tiny alone is what a CPU can run)",
    )
    p.add_argument(
        "--bar",
        type=float,
        default=None,
        help=f"--sample-cells: the least adaptive / max(plain, dflash) a cell passes with (default {DEFAULT_BAR})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (request i seeded i; default 0, greedy): the drafter's own acceptance "
        "under speculative sampling, no --acceptance-profile",
    )
    p.add_argument(
        "--draft-sampling",
        choices=DRAFT_SAMPLINGS,
        default="sampled",
        help="with --temperature > 0: drafts drawn from the drafter's distribution (sampled) or its argmax (greedy)",
    )
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="shared-prefix (a --system-len system prompt + --question-len questions, 4 x c requests, c in "
        "flight) or multi-turn (c chats of --turns turns): TTFT and tok/s for --modes plain,dflash "
        "(refengine/bench/prefix.py)",
    )
    p.add_argument("--system-len", type=int, default=2000, help="--workload: system prompt tokens")
    p.add_argument("--question-len", type=int, default=32, help="--workload: tokens of each question")
    p.add_argument("--turns", type=int, default=4, help="--workload multi-turn: turns of each chat")
    add_prefix_caching_argument(p)
    p.add_argument("--output", help="also write the JSON to this path")
    p.add_argument("--plot", help="write tok/s against concurrency to this image (needs the plot extra)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's top ops for the first concurrency of each row kind (stderr)",
    )
    p.set_defaults(func=lambda args: cmd_matrix(args, p) if args.sample_cells is not None else _cmd(args))


def _cmd(args) -> int:
    from refengine.defaults import default_pair

    for flag in ("pairs", "bar"):
        if getattr(args, flag) is not None:
            raise BenchError(f"--{flag} applies to the cell matrix: give --sample-cells N with it")
    args.seed = 0 if args.seed is None else args.seed
    args.output_tokens = 128 if args.output_tokens is None else args.output_tokens

    if args.target is None:
        t, d = default_pair()
        target, draft = str(t), args.draft or str(d)
    else:
        target, draft = args.target, args.draft
    if args.speculation is not None and args.modes is not None:
        raise BenchError("give --modes or --speculation, not both")
    if args.modes is None:
        args.modes = {"fixed": "plain,dflash", "adaptive": "plain,adaptive"}.get(args.speculation, ",".join(MODES))
    modes = tuple(m.strip() for m in args.modes.split(","))
    if not modes or not set(modes) <= set(MODES):
        raise BenchError(f"--modes {args.modes!r}: use a subset of {','.join(MODES)}")
    if args.repeats < 1 or args.output_tokens < 1 or args.prompt_len < 1:
        raise BenchError("--repeats, --output-tokens and --prompt-len must be positive")
    profiles = [p for p in (args.acceptance_profile or "").split(",") if p.strip()]
    for p in profiles:
        parse_profile(p)  # fail before any model loads
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise BenchError("--plot needs matplotlib: pip install 'refengine[plot]'")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.workload is not None:
        return cmd_workload(args, target, draft, device, modes if args.modes != ",".join(MODES) else None)
    if args.enable_prefix_caching:
        raise BenchError(
            "--enable-prefix-caching applies to --workload shared-prefix / multi-turn (the standard "
            "bench's random prompts share no prefix)"
        )
    res = bench(
        target,
        draft,
        device=device,
        synthetic=args.synthetic,
        concurrency=_ints(args.concurrency, "--concurrency"),
        prompt_len=args.prompt_len,
        output_tokens=args.output_tokens,
        repeats=args.repeats,
        modes=modes,
        profiles=profiles,
        prompts=args.prompts,
        peer=args.peer,
        peer_compile=args.peer_compile,
        max_model_len=args.max_model_len,
        seed=args.seed,
        profile_ops=args.profile,
        graph_mode=args.graph_mode,
        fused_ops=args.fused_ops,
        settle_s=args.settle_s,
        isolate=args.isolate,
        processes=args.processes,
        paired=args.paired,
        share_weights=not args.own_weights,
        arrivals=args.arrivals,
        temperature=args.temperature,
        draft_sampling=args.draft_sampling,
    )
    print_table(
        res["rows"],
        f"refengine bench: {target} ({device}, {args.prompts} prompts, "
        f"{args.output_tokens} new tokens, {args.arrivals} arrivals, T {args.temperature:g}, "
        f"median of {args.repeats * args.processes})",
    )
    text = json.dumps(res)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    if args.plot:
        from refengine.bench.plot import plot

        plot(res["rows"], args.plot, f"{target} ({device}), {args.prompts} prompts")
    print(text)
    return 0


__all__ = ["BenchError", "KEY", "add_bench_parser", "bench", "measure_copy_bandwidth"]
