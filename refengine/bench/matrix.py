"""`refengine bench --sample-cells N --seed S`: a seeded random sample of the cell matrix (cells.py), every cell
measured for plain decode, fixed DFlash and adaptive in the same run, on the same prompts, and judged by
adaptive / max(plain, dflash) against a bar (verdict.py).

How it runs, and why:
- One process per pair (on CUDA a fresh one, as `--isolate` defaults), the pairs in the order the sample
  first names them. It loads the pair's plain, dflash and adaptive engines once, side by side (paired.py's
  design: one copy of the target's weights, every graph shape captured at load, a KV pool sized for the
  pair's largest sampled concurrency), and measures all the pair's cells on them in the sample's order; the
  control (a second plain engine) loads the first time one of its cells is paired. Loading per mode and per
  cell would spend the run on start-ups (a Qwen3-4B-shape speculating engine captures tens of graph shapes up
  to c64), and modes in separate processes differ by the noise between processes (5-11% for one plain
  engine on the H200, docs/PERF.md), more than the 5% the bar allows. Engines side by side in interleaved
  rounds meet the same chip state in each round; the control shows what that leaves.
- A cell: the speculating engines draw the cell's acceptance profile (qwen3-4b) or use the drafter's own
  acceptance (tiny); every engine runs a discarded warm-up (a wave of the cell's first c prompts, 16 new
  tokens each); the adaptive engine then runs the cell's workload (its prompts and arrivals, runs of the
  measured length) for the cell's settle seconds. With settle 0 it meets the cell with what it learnt from
  the pair's previous cell and that warm-up alone: a workload turn, which the sample's random order varies.
  Then `repeats` rounds, each running plain, dflash and adaptive once in a Williams order (paired.round_order).
  Where plain's and dflash's medians are within verdict.PAIR_WITHIN of each other, PAIRED_ROUNDS more rounds
  add the control (one balanced cycle of four engines) and the cell's ratio is paired, round by round
  (verdict.py).
A policy choice that raised in any run fails the whole bench (run.run_once): that run did not measure the
policy.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from refengine.bench.cells import PAIR_SPECS, Cell, matrix, sample_cells
from refengine.bench.floors import measure_copy_bandwidth
from refengine.bench.job import STEADY_ROUNDS, ModeJob, job_own_bytes
from refengine.bench.loading import free_memory, in_fresh_process, load_engine
from refengine.bench.paired import CONTROL, round_order
from refengine.bench.report import aggregate
from refengine.bench.run import (
    BenchError,
    measure_row,
    row_label,
    run_once,
    set_override,
    settle_engine,
)
from refengine.bench.verdict import PAIR_WITHIN, judge, needs_pairing, summarize
from refengine.config import DEFAULT_PAGE_SIZE
from refengine.kv.pool import blocks_for
from refengine.spec_decode.acceptance_profile import AcceptanceOverride, parse_profile

SCREEN = ("plain", "dflash", "adaptive")  # every cell's rounds
PAIRED = ("plain", "control", "dflash", "adaptive")  # a paired cell's further rounds
MODE_OF = {"plain": "plain", "control": "plain", "dflash": "dflash", "adaptive": "adaptive"}
PAIRED_ROUNDS = 4  # one cycle of round_order for four engines: each in each place, after each other, once
METHOD_MATRIX = (
    "cell matrix: per pair one process holding plain, dflash and adaptive (and the control once a cell is"
    " paired) on one copy of the target's weights; each sampled cell in the sample's order: warm-ups, adaptive"
    " settled for the cell's seconds on the cell's workload, `repeats` rounds of plain, dflash and adaptive in a"
    " Williams order, and where plain and dflash are within pair_within of each other, paired_rounds more"
    " rounds with the control"
)


@dataclass(frozen=True)
class PairJob:
    """One pair's share of the sample (pickled to a fresh process on CUDA); run_matrix validates the inputs."""

    pair: str
    cells: tuple[tuple[int, Cell], ...]  # (place in the sample, cell), in the sample's order
    total: int  # cells in the sample (the progress lines' count)
    device: str
    prompt_len: int
    output_tokens: int
    repeats: int
    seed: int
    graph_mode: str | None
    bandwidth: float
    bar: float
    cells_log: str | None = None  # each finished cell appended as a JSON line (a run cut short keeps them)
    fused_ops: tuple[str, ...] | None = None  # EngineConfig.fused_ops (None: the default kernels)

    def mode_job(self) -> ModeJob:
        """What load_engine and the cells' prompts need: the pair's checkpoints, its largest concurrency."""
        spec = PAIR_SPECS[self.pair]
        concurrency = tuple(sorted({c.concurrency for _, c in self.cells}))
        context = self.prompt_len + self.output_tokens + 16
        return ModeJob(
            target=spec.target,
            draft=spec.draft,
            device=self.device,
            synthetic=spec.synthetic,
            concurrency=concurrency,
            prompt_len=self.prompt_len,
            output_tokens=self.output_tokens,
            repeats=self.repeats,
            profiles=(),
            prompts="random",
            context=context,
            blocks=max(concurrency) * blocks_for(context, DEFAULT_PAGE_SIZE),
            seed=self.seed,
            profile_ops=False,
            graph_mode=self.graph_mode,
            settle_s=0.0,
            bandwidth=self.bandwidth,
            fused_ops=self.fused_ops,
        )


def run_matrix(
    sample: int,
    seed: int,
    pairs: tuple[str, ...],
    *,
    device: str,
    prompt_len: int,
    output_tokens: int,
    repeats: int = 3,
    bar: float = 0.95,
    graph_mode: str | None = None,
    fused_ops: tuple[str, ...] | None = None,
    isolate: bool | None = None,
    cells_log: str | None = None,
) -> dict[str, Any]:
    """Draw `sample` cells of the pairs' matrix with `seed`, measure them (the module docstring) and judge them:
    the JSON-ready result, its cells in the sample's order. `cells_log`: a file that gets each finished cell as
    a JSON line (emptied first)."""
    if repeats < 1 or prompt_len < 1 or output_tokens < 1:
        raise BenchError("--repeats, --prompt-len and --output-tokens must be positive")
    if not 0 < bar:
        raise BenchError(f"--bar {bar}: a positive ratio (e.g. 0.95)")
    cells = sample_cells(sample, seed, pairs)
    start = time.perf_counter()
    isolate = device.startswith("cuda") if isolate is None else isolate
    bandwidth = measure_copy_bandwidth(device)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the measurement's buffers: the pairs' engines need the memory
    if cells_log:
        open(cells_log, "w").close()
    results: list[dict[str, Any]] = []
    engines: dict[str, Any] = {}
    for pair in dict.fromkeys(c.pair for c in cells):  # the pairs in the order the sample first names them
        job = PairJob(
            pair=pair,
            cells=tuple((i, c) for i, c in enumerate(cells) if c.pair == pair),
            total=len(cells),
            device=device,
            prompt_len=prompt_len,
            output_tokens=output_tokens,
            repeats=repeats,
            seed=seed,
            graph_mode=graph_mode,
            fused_ops=fused_ops,
            bandwidth=bandwidth,
            bar=bar,
            cells_log=cells_log,
        )
        out = in_fresh_process(measure_pair, job) if isolate else measure_pair(job)
        results.extend(out["cells"])
        engines[pair] = out["engine"]
    results.sort(key=lambda c: c["index"])
    return {
        "method": METHOD_MATRIX,
        "seed": seed,
        "sample_cells": sample,
        "pairs": list(pairs),
        "matrix_cells": len(matrix(pairs)),
        "device": device,
        "isolated": isolate,
        "prompt_len": prompt_len,
        "output_tokens": output_tokens,
        "repeats": repeats,
        "paired_rounds": PAIRED_ROUNDS,
        "pair_within": PAIR_WITHIN,
        "steady_rounds": STEADY_ROUNDS,
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "seconds": round(time.perf_counter() - start, 1),  # the whole measurement, engine loads included
        "engines": engines,
        "cells": results,
        **summarize(results, bar),
    }


def measure_pair(job: PairJob) -> dict[str, Any]:
    """One pair's cells on one set of engines (a top-level function, so it pickles to a fresh process): each
    cell's verdict and rows, and what the JSON records about the engines."""
    from tqdm import tqdm

    j = job.mode_job()
    first = next((parse_profile(c.profile) for _, c in job.cells if c.profile), None)
    engines: dict[str, Any] = {}
    facts: dict[str, Any] = {
        "target": j.target,
        "draft": j.draft,
        "synthetic_weights": j.synthetic,
        "max_concurrency": max(j.concurrency),
        "kv_blocks_per_engine": j.blocks,
        "graph_captures": {},
    }

    def load(name: str) -> None:
        shared = next(iter(engines.values())).target if engines else None  # one copy of the target's weights
        engines[name], got = load_engine(MODE_OF[name], j, first, shared)
        facts["graph_captures"][name] = got.pop("graph_capture")
        facts.update(got)

    t = time.perf_counter()
    for name in SCREEN:
        load(name)
    facts["load_s"] = round(time.perf_counter() - t, 2)
    cells = []
    bar = tqdm(total=len(job.cells), desc=f"bench cells {job.pair}", unit="cell", file=sys.stderr)
    for index, cell in job.cells:
        t = time.perf_counter()
        rounds, rows = measure_cell(engines, load, cell, j, facts)
        verdict = judge(rounds, job.bar)
        cells.append(
            {
                "index": index,
                "label": cell.label,
                **asdict(cell),
                **verdict,
                "seconds": round(time.perf_counter() - t, 2),
                "rows": {name: aggregate(runs) for name, runs in rows.items()},
            }
        )
        bar.write(progress_line(cells[-1], job.total, job.bar), file=sys.stderr)
        if job.cells_log:
            with open(job.cells_log, "a") as f:
                f.write(json.dumps(cells[-1]) + "\n")
        bar.update()
    bar.close()
    for name in list(engines):
        engines.pop(name).close()
    free_memory(j.device)
    return {"cells": cells, "engine": facts}


def measure_cell(
    engines: dict[str, Any], load: Callable[[str], None], cell: Cell, j: ModeJob, facts: dict[str, Any]
) -> tuple[list[dict[str, float]], dict[str, list[dict[str, Any]]]]:
    """One cell on the pair's engines: its rounds (engine name -> tok/s) and each engine's runs (the module
    docstring). `load(name)` adds an engine (the control, the first time a cell is paired)."""
    j = replace(j, prompts=cell.prompts, arrivals=cell.arrivals)
    batch, in_flight = j.cell_prompts(cell.concurrency, facts["vocab"])
    warm_tokens = min(j.output_tokens, 16)
    profile = parse_profile(cell.profile) if cell.profile is not None else None
    labels = {"plain": row_label("plain", None, j.synthetic), "control": CONTROL}
    for name in ("dflash", "adaptive"):  # an override of its own each: its draws follow its own request ids
        override = AcceptanceOverride(profile, j.seed) if profile is not None else None
        set_override(engines[name], override)
        labels[name] = row_label(name, override, j.synthetic)
    for name in SCREEN:
        run_once(engines[name], batch[: cell.concurrency], warm_tokens)  # warm-up (allocator, kernels); discarded
    settle_engine(engines["adaptive"], batch, cell.settle_s, j.output_tokens, in_flight)
    rounds: list[dict[str, float]] = []
    rows: dict[str, list[dict[str, Any]]] = {}
    own_bytes = job_own_bytes(facts)

    def play(names: tuple[str, ...], r: int) -> None:
        got = {}
        for name in round_order(list(names), r):
            row = measure_row(
                engines[name],
                MODE_OF[name],
                labels[name],
                batch,
                j.output_tokens,
                facts["floor"],
                own_bytes,
                j.bandwidth,
                in_flight,
            )
            rows.setdefault(name, []).append(row)
            got[name] = row["tok_per_s"]
        rounds.append(got)

    for r in range(j.repeats):
        play(SCREEN, r)
    if needs_pairing(rounds):
        if "control" not in engines:
            load("control")
        run_once(engines["control"], batch[: cell.concurrency], warm_tokens)
        for r in range(PAIRED_ROUNDS):
            play(PAIRED, r)
    return rounds, rows


def progress_line(cell: dict[str, Any], total: int, bar: float) -> str:
    """A finished cell, one line (stderr)."""
    paired = f" paired, control {cell['control_x_plain']:.3f}" if cell["paired"] else ""
    return (
        f"[{cell['index'] + 1}/{total}] {cell['label']}: plain {cell['plain_tok_per_s']:.1f}, dflash "
        f"{cell['dflash_tok_per_s']:.1f}, adaptive {cell['adaptive_tok_per_s']:.1f} tok/s; x {cell['better']} "
        f"{cell['ratio']:.3f}{paired} ({'ok' if cell['ratio'] >= bar else 'FAIL'} vs {bar:g}; {cell['seconds']:.0f} s)"
    )
