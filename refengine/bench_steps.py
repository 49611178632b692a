"""Per-step timings by graph mode: plain decode, DFlash draft and verify steps at given batch sizes, with the
host (CPU) time per step and the ratio to the memory-bound floor.

    python -m refengine.bench_steps --target fixtures/configs/qwen3-4b --draft fixtures/configs/qwen3-4b-dflash-b16 \\
        --synthetic --modes eager,piecewise,full --batches 1,8,16,32

Each row runs `batch` requests of `--prompt-len` random tokens through prefill, a few warm-up steps (graphs
are captured there), then `--steps` timed steps of the engine's own loop (Engine.step). ms/step is wall time
per step (every step ends with the host reading the argmax back); host ms is the CPU time of the step's
scheduling, input packing, attention planning and kernel launches (the runner's `host_s`). The floor is
weight bytes / measured copy bandwidth: the step time of a batch-1 decode that streams every weight once.
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import torch

from refengine.bench.floors import measure_copy_bandwidth, target_weight_bytes
from refengine.config import EngineConfig
from refengine.request import SamplingParams


def _timed_steps(engine, batch: int, prompt_len: int, warmup: int, steps: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = engine.target.cfg.vocab_size
    for _ in range(batch):
        engine.add_request(
            [rng.randrange(vocab - 1) for _ in range(prompt_len)],
            SamplingParams(max_tokens=1 + (warmup + steps) * 16, ignore_eos=True),
        )
    engine.step()  # prefill (all at once: max_prefill_tokens permitting)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    before = dict(engine.runner.timings)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    delta = {k: (engine.runner.timings[k] - before[k]) * 1e3 / steps for k in before}
    wait = delta.pop("sync_wait_s")
    delta["host_s"] = wall * 1e3 / steps - wait  # everything but waiting on graphed results (graph modes)
    for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(r.request_id, "timed steps done")
    return {"ms_per_step": wall * 1e3 / steps, **{k.replace("_s", "_ms"): v for k, v in delta.items()}}


def run(
    target: str,
    draft: str | None,
    *,
    synthetic: bool,
    modes: list[str],
    batches: list[int],
    prompt_len: int,
    warmup: int,
    steps: int,
    profile: bool,
    kinds: tuple[str, ...] = ("plain", "dflash"),
    fused_ops: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    from refengine.engine import Engine

    bandwidth = measure_copy_bandwidth("cuda")
    rows = []
    for mode in modes:
        for spec in [k == "dflash" for k in kinds if draft or k == "plain"]:
            engine = Engine(
                EngineConfig(
                    target,
                    draft_path=draft if spec else None,
                    device="cuda",
                    synthetic_weights=synthetic,
                    graph_mode=mode,
                    fused_ops=fused_ops,
                    max_num_seqs=max(batches),
                    gpu_memory_utilization=0.5,  # step times need no large pool
                    max_model_len=prompt_len + (warmup + steps + 2) * 16 + 32,
                )
            )
            weight_bytes = target_weight_bytes(engine.target)
            floor_ms = weight_bytes / bandwidth * 1e3
            for b in batches:
                t = _timed_steps(engine, b, prompt_len, warmup, steps, seed=b)
                row = {
                    "fused_ops": ",".join(engine.config.fused_ops_names) or "none",
                    "mode": mode,
                    "kind": "dflash" if spec else "plain",
                    "batch": b,
                    **{k: round(v, 3) for k, v in t.items()},
                    "floor_ms": round(floor_ms, 3),
                    "floor_ratio": round(floor_ms / t["ms_per_step"], 3),
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
                if profile and b == batches[0]:
                    _profile(engine, b, prompt_len, f"{mode} {row['kind']} batch {b}")
            del engine
            torch.cuda.empty_cache()
    return {"bandwidth_bytes_per_s": round(bandwidth), "rows": rows}


def _profile(engine, batch: int, prompt_len: int, label: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _timed_steps(engine, batch, prompt_len, warmup=2, steps=4, seed=99)
    print(f"\n--- profile: {label} ---", file=sys.stderr)
    print(
        prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60),
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m refengine.bench_steps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--modes", default="eager,piecewise,full")
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kinds", default="plain,dflash", help="plain and/or dflash rows")
    p.add_argument(
        "--fused-ops",
        help="FlashInfer kernels to use: comma-separated subset of "
        "rmsnorm,add_rmsnorm,silu_and_mul,rope, or 'none' (default: all)",
    )
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    res = run(
        a.target,
        a.draft,
        synthetic=a.synthetic,
        modes=a.modes.split(","),
        batches=[int(x) for x in a.batches.split(",")],
        prompt_len=a.prompt_len,
        warmup=a.warmup,
        steps=a.steps,
        profile=a.profile,
        kinds=tuple(a.kinds.split(",")),
        fused_ops=None if a.fused_ops is None else tuple(o for o in a.fused_ops.split(",") if o and o != "none"),
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
