"""`refengine bench`: throughput and per-step timings, plain vs DFlash, with the memory-bound floor.

    refengine bench                                   # embedded tiny pair
    refengine bench --target fixtures/configs/qwen3-4b --draft fixtures/configs/qwen3-4b-dflash-b16 \
        --synthetic --concurrency 1,8,16,32 --output-tokens 128

Greedy, ignore_eos, random-token prompts; one warm-up run per configuration is discarded. With synthetic
weights the drafter accepts by chance only (tau ~1): the DFlash rows are then a lower bound, labelled so.
The floor is the memory-bound limit of plain decode: weight bytes / measured HBM copy bandwidth (read +
write), i.e. the tokens/s a batch-1 decode reaches if every step streams every weight once. The last line
printed is JSON. A request that is rejected or does not run its whole budget fails the bench (exit 2, the
request's message on stderr) instead of printing a 0 tok/s row.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import torch

from refengine.config import EngineConfig
from refengine.errors import InvalidRequestError, StepError
from refengine.request import SamplingParams


def measure_copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (CPU: memcpy of a 256 MiB buffer)."""
    n = 1 << 28
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 2 * n * 10 / (time.perf_counter() - t0)


def _run(engine, prompts, new_tokens):
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    if engine.target.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    if engine.target.device.type == "cuda":
        torch.cuda.synchronize()
    _check_ran(reqs, new_tokens)
    return reqs, time.perf_counter() - t0


def _check_ran(reqs, new_tokens: int) -> None:
    """A row is only a measurement if every request ran its whole budget: a rejected or failed request is
    an error (InvalidRequestError / StepError with the request's message), never a 0 tok/s row."""
    for r in reqs:
        if r.reject_reason is not None:
            raise InvalidRequestError(f"bench request {r.request_id} rejected ({r.reject_reason.value}): {r.message}")
        if len(r.output_ids) != new_tokens:
            raise StepError(f"bench request {r.request_id} ran {len(r.output_ids)} of {new_tokens} tokens "
                            f"({r.finish_reason.value if r.finish_reason else 'unfinished'}) {r.message}".rstrip())


def concurrency_list(text: str) -> list[int]:
    """argparse type of --concurrency: comma-separated integers >= 1."""
    try:
        values = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,8,16") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrency {min(values)} in {text!r}: each must be >= 1")
    return values


def positive_int(text: str) -> int:
    """argparse type of --prompt-len / --output-tokens: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def bench(target: str, draft: str | None, *, device: str, synthetic: bool, concurrency: list[int],
          prompt_len: int, output_tokens: int, seed: int = 0, profile: bool = False) -> dict:
    from refengine.engine import Engine

    results: dict[str, Any] = {"target": target, "draft": draft, "device": device, "synthetic_weights": synthetic,
               "prompt_len": prompt_len, "output_tokens": output_tokens, "rows": []}
    bandwidth = measure_copy_bandwidth(device)
    for spec in ([False, True] if draft else [False]):
        engine = Engine(EngineConfig(target, draft_path=draft if spec else None, device=device,
                                     synthetic_weights=synthetic, max_num_seqs=max(concurrency),
                                     max_model_len=prompt_len + output_tokens + 16))
        weight_bytes = sum(t.numel() * t.element_size() for t in _weights(engine.target))
        floor = bandwidth / weight_bytes
        vocab = engine.target.cfg.vocab_size
        for c in concurrency:
            rng = random.Random(seed + c)
            prompts = [[rng.randrange(vocab - 1) for _ in range(prompt_len)] for _ in range(c)]
            _run(engine, prompts[:1], 8)  # warm-up (allocator, kernels); discarded
            before = dict(engine.runner.timings)
            reqs, secs = _run(engine, prompts, output_tokens)
            tokens = sum(len(r.output_ids) for r in reqs)
            delta = {k: engine.runner.timings[k] - before[k] for k in before}
            stats = engine.spec_stats(reqs)
            row = {"mode": "dflash" if spec else "plain", "concurrency": c, "tok_per_s": round(tokens / secs, 2),
                   "seconds": round(secs, 3), "per_request_tok_per_s": round(tokens / secs / c, 2),
                   "memory_bound_floor_tok_per_s": round(floor, 1),
                   "fraction_of_floor_per_request": round(tokens / secs / c / floor, 4)}
            if spec:
                steps = max(stats.verify_steps // c, 1)
                row.update(tau=round(stats.tau, 3), draft_ms_per_step=round(delta["draft_s"] * 1e3 / steps, 3),
                           verify_ms_per_step=round(delta["verify_s"] * 1e3 / steps, 3),
                           acceptance="chance (synthetic weights)" if synthetic else "real drafter")
            else:
                steps = max(output_tokens - 1, 1)
                row.update(decode_ms_per_step=round(delta["decode_s"] * 1e3 / steps, 3))
            results["rows"].append(row)
            print(json.dumps(row))
            if profile and c == concurrency[0]:
                _profile(engine, prompts, min(output_tokens, 16), f"{row['mode']} c={c}")
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    results["copy_bandwidth_bytes_per_s"] = round(bandwidth)
    return results


def _profile(engine, prompts, new_tokens: int, label: str) -> None:
    """Where the time of one short run goes: torch.profiler's top ops, to stderr (not part of the timings)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.target.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        _run(engine, prompts, new_tokens)
    events = prof.key_averages()
    print(f"\n--- profile: {label}, {new_tokens} new tokens ---", file=sys.stderr)
    for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        print(events.table(sort_by=key, row_limit=12, max_name_column_width=48), file=sys.stderr)


def _weights(model):
    yield model.embed_tokens
    if model.lm_head is not model.embed_tokens:
        yield model.lm_head
    yield model.final_norm
    for layer in model.layers:
        yield from vars(layer).values()


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput and step timings, plain vs DFlash (JSON last line)")
    p.add_argument("--target", help="target checkpoint dir or config dir (default: embedded tiny pair)")
    p.add_argument("--draft", help="drafter dir (default with no --target: the embedded drafter)")
    p.add_argument("--synthetic", action="store_true", help="random weights from config.json alone")
    p.add_argument("--device", default=None)
    p.add_argument("--concurrency", type=concurrency_list, default="1,8", help="comma-separated, e.g. 1,8,16,32")
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--output-tokens", type=positive_int, default=128)
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's top ops for the first concurrency of each mode (stderr)")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from refengine.defaults import default_pair
    if args.target is None:
        t, d = default_pair()
        target, draft = str(t), args.draft or str(d)
    else:
        target, draft = args.target, args.draft
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    res = bench(target, draft, device=device, synthetic=args.synthetic,
                concurrency=args.concurrency, prompt_len=args.prompt_len,
                output_tokens=args.output_tokens, profile=args.profile)
    print(json.dumps(res))
    return 0
