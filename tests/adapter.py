"""The bridge between refengine and golden: run the engine and emit golden's plain records.

Tests are the only place that imports both packages; the same records could come from any engine (JSONL).
"""
from __future__ import annotations

from golden.records import TopKRecord
from refengine import Engine, EngineConfig, SamplingParams


def cpu_engine(target, draft=None, proposer=None, **kw) -> Engine:
    """fp32 on the CPU with the torch attention backend. `proposer` replaces the DFlash lane (test proposers)."""
    return Engine(EngineConfig(str(target), draft_path=str(draft) if draft else None, device="cpu", **kw),
                  proposer=proposer)


def gpu_engine(target, draft=None, proposer=None, **kw) -> Engine:
    """bf16 on CUDA with the FlashInfer backend. The tiny pairs get a fixed pool of 8192 blocks (131k tokens,
    plenty) instead of one planned to fill the device: the checks after every step stay cheap. The memory
    tests build their engines themselves to exercise the planner."""
    kw.setdefault("num_blocks", 8192)
    return Engine(EngineConfig(str(target), draft_path=str(draft) if draft else None, device="cuda",
                               dtype="bfloat16", attention_backend="flashinfer", **kw), proposer=proposer)


def score_sequences(engine: Engine, sequences: list[tuple[str, list[int], list[int]]], k: int = 8) -> list[TopKRecord]:
    """Teacher-force each (name, prompt, continuation) through Engine.score, all together: the prompt through
    prefill, the continuation through decode steps. One top-k row per position."""
    scored = engine.score([(prompt, cont) for _, prompt, cont in sequences], k)
    return [TopKRecord(name=name, token_ids=s.token_ids, topk_ids=[ids for ids, _ in s.topk],
                       topk_logprobs=[lps for _, lps in s.topk]) for (name, _, _), s in zip(sequences, scored)]


def greedy(engine: Engine, prompts: list[list[int]], max_tokens: list[int] | int,
           ignore_eos: bool = True) -> list[list[int]]:
    mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    reqs = engine.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=ignore_eos) for m in mts])
    for r in reqs:
        assert r.reject_reason is None, r.message
    return [r.output_ids for r in reqs]


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
