"""`refengine bench`: throughput and per-step timings, plain vs DFlash vs adaptive (and HF as a peer), with the
memory-bound floor. A table on stderr, a tqdm bar on stderr, the JSON as the last line of stdout.

    refengine bench --concurrency 1,8 --prompts mixed                 # embedded trained tiny pair
    refengine bench --target fixtures/configs/qwen3-4b --draft fixtures/configs/qwen3-4b-dflash-b16 \
        --synthetic --acceptance-profile tau1,tau3,tau6.5 --peer hf --plot perf.png --output perf.json

Greedy, ignore_eos; one discarded warm-up per (engine, concurrency); medians over --repeats with the tok/s
spread. --acceptance-profile NAME[,NAME] (benchmark-only: refengine.spec_decode.acceptance_profile) draws the
accepted drafts per step from a named profile: those rows say `acceptance: profile <name>`, their outputs are
not greedy-exact. Without it DFlash rows are labelled 'real drafter' or 'chance (synthetic weights)'. Exit
status 2 with a message when any request is rejected or a row runs no tokens. Column definitions:
refengine/bench/run.py and docs/PERF.md.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from refengine.bench.prompts import PROMPT_SETS, make_prompts
from refengine.bench.report import KEY, aggregate, print_table
from refengine.bench.run import (
    BenchError,
    drafter_weight_bytes,
    engine_for,
    measure_copy_bandwidth,
    measure_row,
    run_once,
    set_override,
    target_weight_bytes,
)
from refengine.spec_decode.acceptance_profile import AcceptanceOverride, parse_profile

MODES = ("plain", "dflash", "adaptive")


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise BenchError(f"{what} {text!r}: give positive integers, comma-separated (e.g. 1,8,16,32)")
    return vals


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
) -> dict[str, Any]:
    from tqdm import tqdm

    if draft is None:
        modes = tuple(m for m in modes if m == "plain")
    parsed = [parse_profile(p) for p in profiles or []]
    bandwidth = measure_copy_bandwidth(device)
    results: dict[str, Any] = {
        "target": target,
        "draft": draft,
        "device": device,
        "synthetic_weights": synthetic,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "output_tokens": output_tokens,
        "repeats": repeats,
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "profiles": {p.name: {"tau": round(p.tau, 4), "description": p.description} for p in parsed},
        "rows": [],
    }
    passes = {m: (parsed or [None]) if m != "plain" else [None] for m in modes}
    total = sum(len(v) for v in passes.values()) * len(concurrency) * repeats + (
        len(concurrency) * repeats if peer else 0
    )
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
    floor = own_bytes = 0.0
    vocab = 0
    for mode in modes:
        first = passes[mode][0]
        engine = engine_for(
            mode,
            target,
            draft,
            device=device,
            synthetic=synthetic,
            max_num_seqs=max(concurrency),
            max_model_len=max_model_len or prompt_len + output_tokens + 16,
            override=AcceptanceOverride(first, seed) if first else None,
            graph_mode=graph_mode,
        )
        t = time.perf_counter()
        captured = engine.capture_graphs()  # no timed step pays a capture
        results.setdefault("graph_captures", {})[mode] = {
            "shapes": captured,
            "seconds": round(time.perf_counter() - t, 2),
        }
        tbytes = target_weight_bytes(engine.target)
        floor, vocab = bandwidth / tbytes, engine.target.cfg.vocab_size
        own_bytes = tbytes + (drafter_weight_bytes(engine.drafter) if engine.drafter is not None else 0)
        results.update(target_weight_bytes=tbytes, graph_mode=engine.config.graph_mode_name)
        if engine.drafter is not None:
            results.update(drafter_weight_bytes=own_bytes - tbytes)
        for prof in passes[mode]:
            override = AcceptanceOverride(prof, seed) if prof else None
            if mode != "plain":
                set_override(engine, override)
            label = (
                override.label
                if override
                else ("-" if mode == "plain" else ("chance (synthetic weights)" if synthetic else "real drafter"))
            )
            for c in concurrency:
                batch = make_prompts(prompts, c, prompt_len, vocab, target, seed)
                run_once(engine, batch, min(output_tokens, 16))  # warm-up (allocator, kernels, policy); discarded
                if engine.scheduler.policy is not None:
                    engine.scheduler.policy.reset_stats()  # the row's decisions only (costs stay learnt)
                runs = []
                for _ in range(repeats):
                    runs.append(
                        measure_row(engine, mode, label, batch, output_tokens, floor, int(own_bytes), bandwidth)
                    )
                    bar.update()
                results["rows"].append(aggregate(runs))
                if profile_ops and c == concurrency[0]:
                    _profile(engine, batch, min(output_tokens, 16), f"{mode} {label} c={c}")
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if peer:
        _peer_rows(
            results,
            target,
            device,
            synthetic,
            concurrency,
            prompts,
            prompt_len,
            output_tokens,
            repeats,
            peer_compile,
            floor,
            vocab,
            seed,
            bar,
        )
    bar.close()
    results["rows"].sort(key=lambda r: (r["concurrency"], r["mode"], r["acceptance"]))
    return results


def _peer_rows(
    results,
    target,
    device,
    synthetic,
    concurrency,
    prompts,
    prompt_len,
    output_tokens,
    repeats,
    compile,
    floor,
    vocab,
    seed,
    bar,
) -> None:
    from refengine.bench.peer_hf import make_peer, peer_row
    from refengine.config import EngineConfig

    dtype = getattr(torch, EngineConfig(target, device=device).torch_dtype_name)
    model, label = make_peer(target, dtype=dtype, device=device, synthetic=synthetic, compile=compile)
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


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput and step timings, plain vs DFlash vs adaptive (JSON last line)")
    p.add_argument("--target", help="target checkpoint dir or config dir (default: embedded tiny pair)")
    p.add_argument("--draft", help="drafter dir (default with no --target: the embedded drafter)")
    p.add_argument("--synthetic", action="store_true", help="random weights from config.json alone")
    p.add_argument("--device", default=None)
    p.add_argument("--concurrency", default="1,8,16,32", help="comma-separated, e.g. 1,8,16,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="measured runs per row (median, min-max reported)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="also write the JSON to this path")
    p.add_argument("--plot", help="write tok/s against concurrency to this image (needs the plot extra)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's top ops for the first concurrency of each row kind (stderr)",
    )
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from refengine.defaults import default_pair

    if args.target is None:
        t, d = default_pair()
        target, draft = str(t), args.draft or str(d)
    else:
        target, draft = args.target, args.draft
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
    )
    print_table(
        res["rows"],
        f"refengine bench: {target} ({device}, {args.prompts} prompts, "
        f"{args.output_tokens} new tokens, median of {args.repeats})",
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
