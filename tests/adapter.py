"""The bridge between refengine and golden: run the engine and emit golden's plain records.

Tests are the only place that imports both packages; the same records could come from any engine (JSONL).
"""
from __future__ import annotations

import torch

from golden.records import TopKRecord
from refengine import Engine, EngineConfig, SamplingParams


def cpu_engine(target, draft=None, proposer=None, **kw) -> Engine:
    """fp32 on the CPU with the torch attention backend. `proposer` replaces the DFlash lane (test proposers)."""
    return Engine(EngineConfig(str(target), draft_path=str(draft) if draft else None, device="cpu", **kw),
                  proposer=proposer)


def gpu_engine(target, draft=None, proposer=None, **kw) -> Engine:
    """bf16 on CUDA with the FlashInfer backend."""
    return Engine(EngineConfig(str(target), draft_path=str(draft) if draft else None, device="cuda",
                               dtype="bfloat16", attention_backend="flashinfer", **kw), proposer=proposer)


def score_sequences(engine: Engine, sequences: list[tuple[str, list[int], list[int]]], k: int = 8) -> list[TopKRecord]:
    """Teacher-force each (name, prompt, continuation) through the engine, all submitted together: the
    prompt through prefill, the continuation through decode steps. One top-k row per position."""
    reqs = []
    for name, prompt, cont in sequences:
        params = SamplingParams(max_tokens=len(cont) + 1, logprobs=k, prompt_logprobs=True, ignore_eos=True)
        reqs.append((name, prompt, cont, engine.add_request(prompt, params, forced_output_ids=cont)))
    while engine.has_work():
        engine.step()
    out = []
    for name, prompt, cont, r in reqs:
        assert r.reject_reason is None, f"{name}: rejected: {r.message}"
        assert r.output_ids[:len(cont)] == cont
        ids = [t for t, _ in r.topk]
        lps = [lp for _, lp in r.topk]
        out.append(TopKRecord(name=name, token_ids=prompt + cont, topk_ids=ids, topk_logprobs=lps))
    return out


def greedy(engine: Engine, prompts: list[list[int]], max_tokens: list[int] | int,
           ignore_eos: bool = True) -> list[list[int]]:
    mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    reqs = engine.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=ignore_eos) for m in mts])
    for r in reqs:
        assert r.reject_reason is None, r.message
    return [r.output_ids for r in reqs]


def lane_persistent_bytes(lane) -> int:
    """Bytes of every live request's drafter context K/V buffers plus its pending target features."""
    total = 0
    for ctx in lane._ctx.values():
        total += sum(t.numel() * t.element_size() for t in ctx.k + ctx.v)
        total += sum(f.numel() * f.element_size() for f in ctx.pending)
    return total


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_tokens(got: list[int], want: list[int], label: str) -> None:
    i = first_divergence(got, want)
    if i is not None:
        raise AssertionError(f"{label}: first divergence at output position {i} of {len(want)}: "
                             f"got {got[max(0, i - 3):i + 4]} want {want[max(0, i - 3):i + 4]}")



