"""The measurement behind `refengine bench`: one engine at a time, on CUDA each in a fresh process. Each mode's
engine is loaded alone (a KV pool of exactly the blocks the bench needs), captures all its graph shapes,
loads the device for SETTLE_S seconds (on CUDA, so no row gets the cold chip), runs every (concurrency,
acceptance profile) cell (a discarded warm-up, then `repeats` measured runs) and exits. Plain does not depend
on the acceptance profile: its row per concurrency is measured once.

Why, as measured on the H200 (docs/PERF.md, "Why one engine at a time"):
- side by side, the same decode graph replayed at different speeds depending on what the other engines ran
  (an adaptive engine forced to span 1 at c1: 3.48 ms a replay, but 3.74-3.83 ms when any drafter work ran
  in that run; the kernels took the same time, the gaps between them did not). With one engine resident
  that work changed nothing (3.58 ms either way).
- one after another in one process, even with the previous engine freed, the first engine ran faster: plain
  first then adaptive third gave adaptive / plain 0.86-0.90 at tau 1; adaptive first then plain second gave
  1.00-1.03. A deployment runs one engine in its process; so does each mode here.
`paired` (paired.py) and the cell matrix (matrix.py) hold their engines side by side in one process instead,
and measure them in interleaved rounds with a control engine for the resolution.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from refengine.bench.floors import measure_copy_bandwidth
from refengine.bench.job import ARRIVALS, STEADY_ROUNDS, ModeJob, job_own_bytes, job_profiles
from refengine.bench.loading import free_memory, in_fresh_process, load_engine
from refengine.bench.paired import METHOD_PAIRED, measure_paired
from refengine.bench.peer_hf import peer_rows
from refengine.bench.prompts import make_prompts
from refengine.bench.report import aggregate
from refengine.bench.run import (
    BenchError,
    measure_row,
    print_profile,
    row_label,
    run_once,
    set_override,
    settle_engine,
)
from refengine.config import DEFAULT_PAGE_SIZE
from refengine.kv.pool import blocks_for
from refengine.spec_decode.acceptance_profile import AcceptanceOverride, AcceptanceProfile, parse_profile

MODES = ("plain", "dflash", "adaptive")  # --modes: plain decode, fixed DFlash spans, the adaptive span policy
METHOD_ISOLATED = (
    "each mode in a fresh process: loaded, settled, then each profile's cells by concurrency (adaptive: settled"
    " again under each later profile)"
)
METHOD_IN_PROCESS = (
    "one engine at a time in this process: each mode loaded alone, settled, each profile's cells (adaptive:"
    " settled again under each later profile), freed"
)
SETTLE_S = 15.0  # CUDA: seconds of load before the first measured run


def bench(
    target: str,
    draft: str | None,
    *,
    device: str,
    synthetic: bool,
    concurrency: list[int],
    prompt_len: int,
    output_tokens: int,
    repeats: int = 3,
    modes: tuple[str, ...] = MODES,
    profiles: list[str] | None = None,
    prompts: str = "random",
    peer: str | None = None,
    peer_compile: bool = False,
    max_model_len: int | None = None,
    seed: int = 0,
    profile_ops: bool = False,
    graph_mode: str | None = None,
    fused_ops: tuple[str, ...] | None = None,
    settle_s: float | None = None,
    isolate: bool | None = None,
    processes: int = 1,
    paired: bool = False,
    share_weights: bool = True,
    arrivals: str = "wave",
    temperature: float = 0.0,
    draft_sampling: str = "sampled",
) -> dict[str, Any]:
    """Every mode's rows (and the peer's). `isolate` (default: on CUDA) measures each mode in a fresh process;
    `processes` > 1 (isolated only) does so that many rounds, the modes taking turns, and each row's medians
    are over every process's runs, with the per-process medians listed (`process_tok_per_s`): the same
    engine measured 452-556 tok/s in four processes on H200s (docs/PERF.md). `paired`: every
    mode in one process with plain and a second plain engine, run by run (refengine/bench/paired.py); with
    `isolate` that process is a fresh one, `processes` of them; `share_weights` (paired): its engines read one
    copy of the target's weights."""
    from tqdm import tqdm

    if arrivals not in ARRIVALS:
        raise BenchError(f"arrivals {arrivals!r}: use one of {', '.join(ARRIVALS)}")
    if temperature and (profiles or peer):
        raise BenchError("--temperature > 0 measures the drafter's own acceptance: no --acceptance-profile, no --peer")
    if peer and arrivals != "wave":
        raise BenchError("--peer hf runs HF generate on waves of prompts: give it --arrivals wave")
    isolate = device.startswith("cuda") if isolate is None else isolate
    if processes < 1 or (processes > 1 and not isolate):
        raise BenchError(f"processes={processes}: give 1, or more with each mode in a fresh process (isolate)")

    if draft is None:
        modes = tuple(m for m in modes if m == "plain")
    if paired and "plain" not in modes:
        raise BenchError(f"--paired measures every mode against plain decode: add plain to --modes {','.join(modes)}")
    cells: list[AcceptanceProfile | None] = [parse_profile(p) for p in profiles or []] or [None]
    bandwidth = measure_copy_bandwidth(device)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the measurement's buffers: the modes' engines (or processes) need the memory
    context = max_model_len or prompt_len + output_tokens + 16
    blocks = max(concurrency) * blocks_for(context, DEFAULT_PAGE_SIZE)
    settle = (SETTLE_S if device.startswith("cuda") else 0.0) if settle_s is None else settle_s
    results: dict[str, Any] = {
        "target": target,
        "draft": draft,
        "device": device,
        "synthetic_weights": synthetic,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "output_tokens": output_tokens,
        "repeats": repeats,
        "kv_blocks_per_engine": blocks,
        "settle_s": settle,
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "profiles": {p.name: {"tau": round(p.tau, 4), "description": p.description} for p in cells if p},
        "graph_captures": {},
        "rows": [],
    }
    job = ModeJob(
        target=target,
        draft=draft,
        device=device,
        synthetic=synthetic,
        concurrency=tuple(concurrency),
        prompt_len=prompt_len,
        output_tokens=output_tokens,
        repeats=repeats,
        profiles=tuple(profiles or ()),
        prompts=prompts,
        context=context,
        blocks=blocks,
        seed=seed,
        profile_ops=profile_ops,
        graph_mode=graph_mode,
        fused_ops=fused_ops,
        settle_s=settle,
        bandwidth=bandwidth,
        share_weights=share_weights,
        arrivals=arrivals,
        temperature=temperature,
        draft_sampling=draft_sampling,
    )
    runs: dict[tuple[str, str, int], list[list[dict[str, Any]]]] = {}  # cell -> each process's runs
    floor, vocab = 0.0, 0
    if paired:  # every mode in one process with plain and a control (refengine/bench/paired.py)
        calls: list[tuple[Callable[..., dict[str, Any]], tuple]] = [(measure_paired, (modes, job))]
    else:
        calls = [(measure_mode, (mode, job)) for mode in modes]
    for _ in range(processes):
        for fn, args in calls:
            # a fresh process per mode, or for the paired engines (see the module docstring)
            out = in_fresh_process(fn, *args) if isolate else fn(*args)
            for cell, cell_runs in out.pop("runs").items():
                runs.setdefault(cell, []).append(cell_runs)
            results["graph_captures"].update(out.pop("graph_captures"))
            floor, vocab = out.pop("floor"), out.pop("vocab")
            results.update(out)
    results["method"] = METHOD_PAIRED if paired else (METHOD_ISOLATED if isolate else METHOD_IN_PROCESS)
    if paired:
        results["weights"] = "shared" if share_weights else "one copy per engine"
    results["processes"] = processes
    results["arrivals"] = (
        arrivals
        if arrivals == "wave"
        else f"steady: {STEADY_ROUNDS} x c requests, c in flight (the first c's budgets spread over the output length)"
    )
    results["rows"] = [_row(per_process) for per_process in runs.values()]
    if peer:
        bar = tqdm(total=len(concurrency) * repeats, desc="bench hf", unit="run", file=sys.stderr)
        peer_rows(results, concurrency, peer_compile, floor, vocab, seed, bar)
        bar.close()
    results["rows"].sort(key=lambda r: (r["concurrency"], r["mode"], r["acceptance"]))
    return results


def _row(per_process: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A cell's row over every process's runs; with several processes, each one's median tok/s (and paired
    ratio) too."""
    row = aggregate([r for runs in per_process for r in runs])
    if len(per_process) > 1:
        for key, out in (("tok_per_s", "process_tok_per_s"), ("paired_x_plain", "process_paired_x_plain")):
            if key in row:
                row[out] = [round(statistics.median(r[key] for r in runs), 4) for runs in per_process]
    return row


def measure_mode(mode: str, j: ModeJob) -> dict[str, Any]:
    """One mode's engine: load, capture every graph shape, settle, then each profile's cells by concurrency
    (adaptive settles again under each profile after the first: run after another profile's cells, its
    estimates began each cell where the last left off, a workload turn every few hundred tokens).
    Returns its runs by (mode, label, concurrency) and what the JSON records about it. Runs in a fresh
    process on CUDA (a top-level function, so it pickles)."""
    from tqdm import tqdm

    cells = job_profiles(j)
    e, out = load_engine(mode, j, cells[0])
    out["graph_captures"] = {mode: out.pop("graph_capture")}
    floor, vocab, own_bytes = out["floor"], out["vocab"], job_own_bytes(out)
    settle_batch = make_prompts(j.prompts, max(j.concurrency), j.prompt_len, vocab, j.target, j.seed)
    settle_engine(e, settle_batch, j.settle_s, j.output_tokens)
    bar = tqdm(
        total=len(j.concurrency) * j.repeats * (1 if mode == "plain" else len(cells)),
        desc=f"bench {mode}",
        unit="run",
        file=sys.stderr,
    )
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for k, prof in enumerate(cells if mode != "plain" else [None]):  # plain does not depend on the profile
        override = AcceptanceOverride(prof, j.seed) if prof is not None else None
        if mode != "plain":
            set_override(e, override)
        if mode == "adaptive" and k:  # the policy learns: its estimates describe this profile, not the last one
            settle_engine(e, settle_batch, j.settle_s, j.output_tokens)
        label = row_label(mode, override, j.synthetic)
        for c in j.concurrency:
            batch, in_flight = j.cell_prompts(c, vocab)
            run_once(e, batch[:c], min(j.output_tokens, 16))  # warm-up (allocator, kernels, policy); discarded
            for _ in range(j.repeats):
                row = measure_row(
                    e, mode, label, batch, j.output_tokens, floor, int(own_bytes), j.bandwidth, in_flight, j.temperature
                )
                runs.setdefault((mode, label, c), []).append(row)
                bar.update()
            if j.profile_ops and c == j.concurrency[0]:
                print_profile(e, batch[:c], min(j.output_tokens, 16), f"{mode} {label} c={c}")
    bar.close()
    e.close()
    del e  # in-process: freed before the next mode's engine (or the peer) loads its own copy of the weights
    free_memory(j.device)
    out["runs"] = runs
    return out
