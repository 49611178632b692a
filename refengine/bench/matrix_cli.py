"""`refengine bench --sample-cells N`: the cell matrix's command (the measurement: matrix.py; the cells:
cells.py; the verdicts and the table: verdict.py). The table and the worst cell go to stderr, the JSON is the
last line of stdout; with --output PATH, PATH.cells.jsonl gets each cell as it finishes."""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from refengine.bench.cells import PAIRS, parse_pairs
from refengine.bench.run import BenchError
from refengine.bench.verdict import DEFAULT_BAR

# options of the row bench that the cell matrix sets per cell or does not use
NOT_FOR_MATRIX = (
    "target",
    "draft",
    "synthetic",
    "concurrency",
    "modes",
    "speculation",
    "acceptance_profile",
    "prompts",
    "settle_s",
    "processes",
    "paired",
    "own_weights",
    "arrivals",
    "peer",
    "peer_compile",
    "max_model_len",
    "plot",
    "profile",
)
CELL_TOKENS = 64  # --sample-cells: new tokens a request by default (matrix.py; the run's length budget)


def cmd_matrix(args, parser: argparse.ArgumentParser) -> int:
    """`--sample-cells N`: the cell matrix (refengine/bench/matrix.py)."""
    from refengine.bench.matrix import run_matrix
    from refengine.bench.verdict import table

    given = [f"--{k.replace('_', '-')}" for k in NOT_FOR_MATRIX if getattr(args, k) != parser.get_default(k)]
    if given:
        raise BenchError(
            f"--sample-cells draws every cell's pair, workload, concurrency, arrivals and settle from the matrix "
            f"(refengine/bench/cells.py): {', '.join(given)} does not apply (restrict the matrix with --pairs)"
        )
    seed = random.SystemRandom().randrange(2**31) if args.seed is None else args.seed
    print(f"bench --sample-cells {args.sample_cells}: seed {seed} (--seed {seed} repeats the sample)", file=sys.stderr)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bar = DEFAULT_BAR if args.bar is None else args.bar
    res = run_matrix(
        args.sample_cells,
        seed,
        parse_pairs(args.pairs or ",".join(PAIRS)),
        device=device,
        prompt_len=args.prompt_len,
        output_tokens=CELL_TOKENS if args.output_tokens is None else args.output_tokens,
        repeats=args.repeats,
        bar=bar,
        graph_mode=args.graph_mode,
        fused_ops=args.fused_ops,
        isolate=args.isolate,
        cells_log=f"{args.output}.cells.jsonl" if args.output else None,
    )
    worst = res["worst"]
    print(
        f"\nrefengine bench --sample-cells {args.sample_cells} --seed {seed} ({device}, {res['output_tokens']} new "
        f"tokens, {res['repeats']} rounds a cell, +{res['paired_rounds']} paired with a control where plain and "
        f"dflash are within {res['pair_within']:.0%})\n{table(res['cells'], bar)}\n"
        f"worst: {worst['label']} at {worst['ratio']:.3f} x the better ({worst['better']}); bar {bar:g} "
        f"{'holds' if res['bar_holds'] else 'FAILS: ' + ', '.join(res['failing'])}",
        file=sys.stderr,
    )
    text = json.dumps(res)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
