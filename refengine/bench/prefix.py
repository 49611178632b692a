"""Shared-prefix workloads for `refengine bench --workload`: what the prefix cache is for, measured as time to
first token (TTFT, from submission to the step that produced a request's first token, queueing included) and
tokens a second, for plain decode and DFlash, with the cache on (`--enable-prefix-caching`) or off.

- `shared-prefix`: one system prompt of --system-len tokens, then per concurrency c, 4 x c requests (the
  system prompt + a question of --question-len tokens), c in flight, the next submitted as one finishes. One
  untimed request first, so the system prompt is cached (as on a server that has been running) and every
  engine is warm.
- `multi-turn`: per concurrency c, c chats of --turns turns, each turn submitted together once the last
  finished; a turn's prompt is the last one + its output + a new question (the system prompt first).

Token ids are random (seeded; ignore_eos), so outputs run their full --output-tokens. Each engine runs in
this process, one after another, the last one freed before the next is built (on CUDA, compare rows of
separate runs with care: docs/ENGINE.md).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from typing import Any

import torch

from refengine.bench.loading import free_memory
from refengine.errors import UnsupportedConfigError
from refengine.request import Request, SamplingParams

WORKLOADS = ("shared-prefix", "multi-turn")
REQUESTS_PER_SLOT = 4  # shared-prefix: requests per concurrency slot


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab - 1) for _ in range(n)]


class _Clock:
    """Steps an engine, noting each request's first-token time."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.submitted: dict[int, float] = {}  # request id -> perf_counter time
        self.first: dict[int, float] = {}
        self.cuda = engine.target.device.type == "cuda"

    def add(self, prompt: list[int], tokens: int) -> Request:
        req = self.engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
        if req.reject_reason is not None:
            raise UnsupportedConfigError(f"a bench request was rejected ({req.reject_reason.value}): {req.message}")
        self.submitted[req.request_id] = time.perf_counter()
        return req

    def step(self, live: list[Request]) -> None:
        self.engine.step()
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        for r in live:
            if r.output_ids and r.request_id not in self.first:
                self.first[r.request_id] = now

    def ttft_ms(self, reqs: list[Request]) -> list[float]:
        return [(self.first[r.request_id] - self.submitted[r.request_id]) * 1e3 for r in reqs]


def _shared_prefix(clock: _Clock, c: int, system: list[int], rng: random.Random, args: Any, vocab: int) -> list:
    queue = [system + _ids(rng, args.question_len, vocab) for _ in range(REQUESTS_PER_SLOT * c)]
    reqs: list[Request] = []
    running: list[Request] = []
    while queue or running:
        while queue and len(running) < c:
            req = clock.add(queue.pop(0), args.output_tokens)
            reqs.append(req)
            running.append(req)
        clock.step(running)
        running = [r for r in running if not r.finished]
    return reqs


def _multi_turn(clock: _Clock, c: int, system: list[int], rng: random.Random, args: Any, vocab: int) -> list:
    prompts = [system + _ids(rng, args.question_len, vocab) for _ in range(c)]
    reqs: list[Request] = []
    for _ in range(args.turns):
        wave = [clock.add(p, args.output_tokens) for p in prompts]
        while not all(r.finished for r in wave):
            clock.step(wave)
        reqs += wave
        prompts = [list(r.prompt_ids) + r.output_ids + _ids(rng, args.question_len, vocab) for r in wave]
    return reqs


def _engine(mode: str, target: str, draft: str | None, args: Any, device: str, seqs: int, context: int) -> Any:
    from refengine.config import EngineConfig
    from refengine.engine import Engine

    cfg = EngineConfig(
        target,
        draft_path=draft if mode != "plain" else None,
        device=device,
        synthetic_weights=args.synthetic,
        max_num_seqs=seqs,
        max_model_len=context,
        graph_mode=args.graph_mode,
        fused_ops=args.fused_ops,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    engine = Engine(cfg)
    engine.capture_graphs()
    return engine


def run_workload(
    args: Any, target: str, draft: str | None, device: str, modes: tuple[str, ...], concurrency: list[int]
) -> list[dict[str, Any]]:
    """One row per (mode, concurrency): TTFT median / p90 (ms), tokens a second, the cache's hit rate."""
    from refengine.config import ModelConfig, read_config_json

    if args.workload not in WORKLOADS:
        raise UnsupportedConfigError(f"--workload {args.workload!r}: use one of {WORKLOADS}")
    bad = [m for m in modes if m not in ("plain", "dflash")]
    if bad or not modes:
        raise UnsupportedConfigError(f"--workload measures --modes plain and/or dflash, got {list(modes)}")
    if min(args.system_len, args.question_len, args.turns, args.output_tokens, *concurrency) < 1:
        raise UnsupportedConfigError("--system-len, --question-len, --turns, --output-tokens must be positive")
    vocab = ModelConfig.from_hf(read_config_json(target)).vocab_size
    turns = args.turns if args.workload == "multi-turn" else 1
    context = args.system_len + turns * (args.question_len + args.output_tokens) + 16
    run = _multi_turn if args.workload == "multi-turn" else _shared_prefix
    rows = []
    for mode in modes:
        engine = _engine(mode, target, draft, args, device, max(concurrency), context)
        system = _ids(random.Random(args.seed), args.system_len, vocab)
        clock = _Clock(engine)
        warm = clock.add(system + _ids(random.Random(args.seed + 1), args.question_len, vocab), args.output_tokens)
        while not warm.finished:  # untimed: the system prompt cached (cache on), the engine warm
            clock.step([warm])
        for c in concurrency:
            tps, ttft, cached, prompt, tau = [], [], 0, 0, []
            for rep in range(args.repeats):
                t0 = time.perf_counter()
                reqs = run(clock, c, system, random.Random(args.seed + 1000 * c + rep + 2), args, vocab)
                wall = time.perf_counter() - t0
                tps.append(sum(len(r.output_ids) for r in reqs) / wall)
                ttft += clock.ttft_ms(reqs)
                cached += sum(r.cached_tokens for r in reqs)
                prompt += sum(len(r.prompt_ids) for r in reqs)
                tau.append(engine.spec_stats(reqs).tau)
            rows.append(
                {
                    "workload": args.workload,
                    "mode": mode,
                    "prefix_caching": args.enable_prefix_caching,
                    "concurrency": c,
                    "requests": len(reqs),
                    "ttft_ms_median": round(statistics.median(ttft), 2),
                    "ttft_ms_p90": round(statistics.quantiles(ttft, n=10)[-1] if len(ttft) > 1 else ttft[0], 2),
                    "tok_per_s": round(statistics.median(tps), 2),
                    "cached_token_share": round(cached / prompt, 4),
                    "tau": round(statistics.median(tau), 3) if mode != "plain" else None,
                }
            )
        rows[-1]["cache"] = engine.prefix_cache_stats()
        engine.close()
        del engine, clock, warm
        free_memory(device)  # the next mode's engine plans its KV pools on what is free
    return rows


COLUMNS: tuple[str, ...] = ("mode", "prefix_caching", "concurrency", "requests", "ttft_ms_median", "ttft_ms_p90")
COLUMNS += ("tok_per_s", "cached_token_share", "tau")


def workload_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table (stderr)."""
    cells = [list(COLUMNS)] + [["" if r.get(k) is None else str(r[k]) for k in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]])


def cmd_workload(args: Any, target: str, draft: str | None, device: str, modes: tuple[str, ...] | None) -> int:
    """`refengine bench --workload`: the table on stderr, the JSON last on stdout (modes None: plain, dflash)."""
    rows = run_workload(args, target, draft, device, modes or ("plain", "dflash"), _ints(args.concurrency))
    cache = "on" if args.enable_prefix_caching else "off"
    print(
        f"\nrefengine bench --workload {args.workload}: {target} ({device}, system prompt {args.system_len}, "
        f"questions {args.question_len}, {args.output_tokens} new tokens, prefix caching {cache})\n"
        + workload_table(rows),
        file=sys.stderr,
    )
    text = json.dumps({"workload": args.workload, "rows": rows})
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise UnsupportedConfigError(f"--concurrency {text!r}: comma-separated integers") from e
