"""The measurement behind `refengine bench`: one engine at a time. Each mode's engine is loaded alone (a KV
pool of exactly the blocks the bench needs), captures all its graph shapes, loads the device for SETTLE_S
seconds (on CUDA, so no row gets the cold chip), runs every (concurrency, acceptance profile) cell (a
discarded warm-up, then `repeats` measured runs) and is freed before the next mode loads.

Why not side by side: with several engines resident in one process, the H200 replayed the same decode graph
at different speeds depending on what else ran in the run (measured: an adaptive engine forced to span 1 at
c1, 3.48 ms per replay, but 3.74-3.83 ms when any drafter work ran in that run; the extra time is between
kernels, not in them). With one engine resident, that drafter work changed nothing (3.58 ms either way). A
deployment runs one engine, so the bench does too. Plain does not depend on the acceptance profile: its row
per concurrency is measured once.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import torch

from refengine.bench.prompts import make_prompts
from refengine.bench.report import aggregate
from refengine.bench.run import (
    drafter_weight_bytes,
    engine_for,
    measure_copy_bandwidth,
    measure_row,
    run_once,
    set_override,
    target_weight_bytes,
)
from refengine.config import DEFAULT_PAGE_SIZE
from refengine.kv.pool import blocks_for
from refengine.spec_decode.acceptance_profile import AcceptanceOverride, AcceptanceProfile, parse_profile

MODES = ("plain", "dflash", "adaptive")
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
    settle_s: float | None = None,
) -> dict[str, Any]:
    from tqdm import tqdm

    if draft is None:
        modes = tuple(m for m in modes if m == "plain")
    cells: list[AcceptanceProfile | None] = [parse_profile(p) for p in profiles or []] or [None]
    bandwidth = measure_copy_bandwidth(device)
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
        "method": "one engine at a time: each mode loaded alone, settled, then every (concurrency, profile) cell",
        "kv_blocks_per_engine": blocks,
        "settle_s": settle,
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "profiles": {p.name: {"tau": round(p.tau, 4), "description": p.description} for p in cells if p},
        "graph_captures": {},
        "rows": [],
    }
    total = len(concurrency) * repeats * sum(1 if m == "plain" else len(cells) for m in modes)
    total += len(concurrency) * repeats if peer else 0
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    floor, vocab = 0.0, 0  # from the first engine's target (every mode loads the same one)
    for mode in modes:
        e = engine_for(
            mode,
            target,
            draft,
            device=device,
            synthetic=synthetic,
            max_num_seqs=max(concurrency),
            max_model_len=context,
            override=AcceptanceOverride(cells[0], seed) if cells[0] is not None and mode != "plain" else None,
            graph_mode=graph_mode,
            num_blocks=blocks,
        )
        t = time.perf_counter()
        shapes = e.capture_graphs()  # no timed step pays a capture
        results["graph_captures"][mode] = {"shapes": shapes, "seconds": round(time.perf_counter() - t, 2)}
        if not floor:
            tbytes = target_weight_bytes(e.target)
            floor, vocab = bandwidth / tbytes, e.target.cfg.vocab_size
            results.update(target_weight_bytes=tbytes, graph_mode=e.config.graph_mode_name)
        if e.drafter is not None and "drafter_weight_bytes" not in results:
            results["drafter_weight_bytes"] = drafter_weight_bytes(e.drafter)
        own_bytes = results["target_weight_bytes"] + results.get("drafter_weight_bytes", 0)
        _settle(e, make_prompts(prompts, max(concurrency), prompt_len, vocab, target, seed), settle)
        for c in concurrency:
            batch = make_prompts(prompts, c, prompt_len, vocab, target, seed)
            for prof in cells if mode != "plain" else [None]:  # plain does not depend on the profile
                override = AcceptanceOverride(prof, seed) if prof is not None else None
                if mode != "plain":
                    set_override(e, override)
                label = _label(mode, override, synthetic)
                run_once(e, batch, min(output_tokens, 16))  # warm-up (allocator, kernels, policy); discarded
                if e.scheduler.policy is not None:
                    e.scheduler.policy.reset_stats()  # the row's decisions only (costs stay learnt)
                for _ in range(repeats):
                    runs.setdefault((mode, label, c), []).append(
                        measure_row(e, mode, label, batch, output_tokens, floor, int(own_bytes), bandwidth)
                    )
                    bar.update()
                if profile_ops and c == concurrency[0]:
                    _profile(e, batch, min(output_tokens, 16), f"{mode} {label} c={c}")
        e.close()
        del e  # freed before the next mode's engine (or the peer) loads its own copy of the weights
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    results["rows"] = [aggregate(v) for v in runs.values()]
    if peer:
        _peer_rows(results, concurrency, peer_compile, floor, vocab, seed, bar)
    bar.close()
    results["rows"].sort(key=lambda r: (r["concurrency"], r["mode"], r["acceptance"]))
    return results


def _label(mode: str, override: AcceptanceOverride | None, synthetic: bool) -> str:
    if override is not None and mode != "plain":
        return override.label
    return "-" if mode == "plain" else ("chance (synthetic weights)" if synthetic else "real drafter")


def _settle(engine, batch: list[list[int]], seconds: float) -> None:
    """Load the device for `seconds` (untimed runs) so the first measured row meets its sustained clocks."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        run_once(engine, batch, 32)


def _peer_rows(results: dict[str, Any], concurrency, compile: bool, floor: float, vocab: int, seed: int, bar) -> None:
    """HF `generate` rows on the run's checkpoint, prompts, lengths and repeats (read back from `results`)."""
    from refengine.bench.peer_hf import make_peer, peer_row
    from refengine.config import EngineConfig

    target, device, prompts = results["target"], results["device"], results["prompts"]
    prompt_len, output_tokens, repeats = results["prompt_len"], results["output_tokens"], results["repeats"]
    dtype = getattr(torch, EngineConfig(target, device=device).torch_dtype_name)
    model, label = make_peer(
        target, dtype=dtype, device=device, synthetic=results["synthetic_weights"], compile=compile
    )
    for c in concurrency:
        batch = make_prompts(prompts, c, prompt_len, vocab, target, seed)
        peer_row(model, label, batch, min(output_tokens, 8), device, floor)  # warm-up
        runs = []
        for _ in range(repeats):
            runs.append(peer_row(model, label, batch, output_tokens, device, floor))
            bar.update()
        results["rows"].append(aggregate(runs))


def _profile(engine, prompts, new_tokens: int, label: str) -> None:
    """Where the time of one short run goes: torch.profiler's top ops, to stderr (not part of the timings)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.target.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run_once(engine, prompts, new_tokens)
    events = prof.key_averages()
    print(f"\n--- profile: {label}, {new_tokens} new tokens ---", file=sys.stderr)
    for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        print(events.table(sort_by=key, row_limit=12, max_name_column_width=48), file=sys.stderr)
