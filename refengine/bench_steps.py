"""Per-step timings by graph mode: plain decode, DFlash draft and verify steps at given batch sizes, with the
host (CPU) time per step and the ratio to the memory-bound floor.

    python -m refengine.bench_steps --target fixtures/configs/qwen3-4b --draft fixtures/configs/qwen3-4b-dflash-b16 \\
        --synthetic --modes eager,piecewise,full --batches 1,8,16,32

Each row runs `batch` requests of `--prompt-len` random tokens through prefill, a few warm-up steps (graphs
are captured there), then `--steps` timed steps of the engine's own loop (Engine.step). ms/step is wall time
per step (every step ends with the host reading the argmax back); host ms is the CPU time of the step's
scheduling, input packing, attention planning and kernel launches (the runner's `host_s`); critical ms, the part
of it between reading a step's results back and queueing the next graph, while the device has nothing to run
(the runner's `critical_s`; graph modes). `--device cpu` runs the tiny pairs for the host columns alone. The
floor is weight bytes / measured copy bandwidth: the step time of a batch-1 decode that streams every weight once;
DFlash rows add the drafter's own floor (its weight bytes, LM head included, over the same bandwidth) and the draft
ms's ratio to it. `--profile` (every row, once every row is timed, on engines built again) prints torch.profiler's
top kernels over 4 steps and adds the device's idle time to the row: `gpu_idle_ms_per_step` (the gaps between its
kernels and copies, from the first one's start to the last one's end, per step: host work on the critical path,
as slowed by the profiler's own tracing), `gpu_widest_gap_ms`, `gpu_busy_share`. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from typing import Any

import torch

from refengine.bench.floors import drafter_weight_bytes, measure_copy_bandwidth, sync_device, target_weight_bytes
from refengine.config import EngineConfig
from refengine.defaults import add_fused_ops_argument
from refengine.request import SamplingParams


def _timed_steps(
    engine, batch: int, prompt_len: int, warmup: int, steps: int, seed: int, around=contextlib.nullcontext
) -> dict[str, float]:
    """`around()`: a context manager entered around the timed steps alone (the profiler)."""
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
    sync_device(str(engine.target.device))
    before = dict(engine.runner.timings)
    with around():
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync_device(str(engine.target.device))
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
    device: str = "cuda",
) -> dict[str, Any]:
    from refengine.engine import Engine

    def build(mode: str, spec: bool) -> Engine:
        return Engine(
            EngineConfig(
                target,
                draft_path=draft if spec else None,
                device=device,
                synthetic_weights=synthetic,
                graph_mode=mode,
                fused_ops=fused_ops,
                max_num_seqs=max(batches),
                gpu_memory_utilization=0.5,  # step times need no large pool
                max_model_len=prompt_len + (warmup + steps + 2) * 16 + 32,
            )
        )

    bandwidth = measure_copy_bandwidth(device)
    shapes = [(mode, spec) for mode in modes for spec in [k == "dflash" for k in kinds if draft or k == "plain"]]
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}  # (mode, kind, batch) -> its row
    for mode, spec in shapes:
        engine, kind = build(mode, spec), "dflash" if spec else "plain"
        floor_ms = target_weight_bytes(engine.target) / bandwidth * 1e3
        draft_floor_ms = drafter_weight_bytes(engine.drafter) / bandwidth * 1e3 if spec else None
        for b in batches:
            t = _timed_steps(engine, b, prompt_len, warmup, steps, seed=b)
            row = {
                "fused_ops": ",".join(engine.config.fused_ops_run) or "none",
                "mode": mode,
                "kind": kind,
                "batch": b,
                **{k: round(v, 3) for k, v in t.items()},
                "floor_ms": round(floor_ms, 3),
                "floor_ratio": round(floor_ms / t["ms_per_step"], 3),
            }
            if draft_floor_ms is not None and t["draft_ms"] > 0:  # the drafter's step against its own floor
                row["draft_floor_ms"] = round(draft_floor_ms, 3)
                row["draft_floor_ratio"] = round(draft_floor_ms / t["draft_ms"], 3)
            rows[mode, kind, b] = row
            print(json.dumps(row), file=sys.stderr)
        del engine
        _release(device)
    # profiles after every timed row, on engines built again: host work timed after a profiler session in the
    # same process is not the engine's own
    for mode, spec in shapes if profile else []:
        engine, kind = build(mode, spec), "dflash" if spec else "plain"
        for b in batches:
            row = rows[mode, kind, b]
            row.update(_profile(engine, b, prompt_len, f"{mode} {kind} batch {b}"))
            print(json.dumps(row), file=sys.stderr)
        del engine
        _release(device)
    return {"bandwidth_bytes_per_s": round(bandwidth), "rows": list(rows.values())}


def _release(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _profile(engine, batch: int, prompt_len: int, label: str) -> dict[str, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    steps = 4
    prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    _timed_steps(engine, batch, prompt_len, warmup=2, steps=steps, seed=99, around=lambda: prof)
    print(f"\n--- profile: {label} ---", file=sys.stderr)
    print(
        prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60),
        file=sys.stderr,
    )
    device = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not device:
        print("no device events in the profile: GPU idle time not read", file=sys.stderr)
        return {}
    return device_idle(device, steps)


def device_idle(intervals: list[tuple[float, float]], steps: int) -> dict[str, float]:
    """The device's idle time between `intervals` (us: its kernels and copies, overlapping or not), from the
    first one's start to the last one's end: per step and the widest gap (ms), and the busy share."""
    if not intervals or steps < 1:
        raise ValueError("device_idle needs device intervals and steps >= 1")
    spans = sorted(intervals)
    start, busy_to = spans[0]
    idle = widest = 0.0
    for s, e in spans[1:]:
        if s > busy_to:
            idle, widest = idle + s - busy_to, max(widest, s - busy_to)
        busy_to = max(busy_to, e)
    window = busy_to - start
    return {
        "gpu_idle_ms_per_step": round(idle / 1e3 / steps, 4),
        "gpu_widest_gap_ms": round(widest / 1e3, 4),
        "gpu_busy_share": round(1.0 - idle / window, 4) if window > 0 else 1.0,
    }


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
    add_fused_ops_argument(p)
    p.add_argument("--profile", action="store_true", help="torch.profiler's top kernels and the GPU's idle time (CUDA)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu: host-time columns of the tiny pairs")
    a = p.parse_args(argv)
    if a.profile and not a.device.startswith("cuda"):
        p.error("--profile reads the GPU's idle time: it needs --device cuda")
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
        fused_ops=a.fused_ops,
        device=a.device,
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
