"""Loading and freeing bench engines, shared by every measurement method (suite.py one mode at a time,
paired.py side by side, matrix.py per pair): an engine built by run.engine_for with every CUDA graph shape
captured up front (no timed step pays a capture), and what the JSON records about it."""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import torch

from refengine.bench.floors import drafter_weight_bytes, target_weight_bytes
from refengine.bench.job import ModeJob
from refengine.bench.run import engine_for
from refengine.spec_decode.acceptance_profile import AcceptanceOverride, AcceptanceProfile


def load_engine(
    mode: str, j: ModeJob, first: AcceptanceProfile | None, shared_target: Any = None
) -> tuple[Any, dict[str, Any]]:
    """A mode's engine with every graph shape captured, under the profile `first` (None: the drafter's own
    acceptance); and what the JSON records about it (graph_capture, floor, vocab, weight bytes, graph_mode).
    `shared_target`: another engine's loaded target, read instead of a copy of its own."""
    e = engine_for(
        mode,
        j.target,
        j.draft,
        device=j.device,
        synthetic=j.synthetic,
        max_num_seqs=max(j.concurrency),
        max_model_len=j.context,
        override=AcceptanceOverride(first, j.seed) if first is not None and mode != "plain" else None,
        graph_mode=j.graph_mode,
        num_blocks=j.blocks,
        shared_target=shared_target,
        draft_sampling=j.draft_sampling,
        fused_ops=j.fused_ops,
    )
    t = time.perf_counter()
    shapes = e.capture_graphs()
    out: dict[str, Any] = {"graph_capture": {"shapes": shapes, "seconds": round(time.perf_counter() - t, 2)}}
    tbytes = target_weight_bytes(e.target)
    out.update(floor=j.bandwidth / tbytes, vocab=e.target.cfg.vocab_size, target_weight_bytes=tbytes)
    out["graph_mode"] = e.config.graph_mode_name
    out["fused_ops"] = list(e.config.fused_ops_run)
    if e.drafter is not None:
        out["drafter_weight_bytes"] = drafter_weight_bytes(e.drafter)
    return e, out


def free_memory(device: str) -> None:
    """Give the memory of engines no longer referenced back before the next one loads (in-process runs).
    capture_graphs froze the collector's objects (gc.freeze), so a reference cycle through a closed engine would
    outlive it: unfreeze, collect, and hand the allocator's cached blocks back."""
    gc.unfreeze()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def in_fresh_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """fn(*args) in a freshly spawned process (fn top-level and its arguments picklable): on CUDA no engine
    measured there shares its process with engines loaded, run or freed before (suite.py's docstring)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()
