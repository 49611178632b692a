"""Cache-on vs cache-off scenarios for the prefix-cache gates (tests/golden/test_lossless_prefix_cache*.py,
tests/gpu/test_gpu_prefix_cache.py): prompts (a chat system prompt and questions, through the pair's
tokenizer or as seeded ids), running one flow on both engines, and the acceptance-equality gate (per request:
accepted lengths per verify step, drafts per draft step, the first draft's logits)."""

from __future__ import annotations

import json
import random
import zlib
from collections import defaultdict

import torch

from refengine import SamplingParams
from tests.adapter import assert_same_tokens, cpu_engine, first_divergence

PAGE = 16
LOGITS_TOL = 1e-3  # fp32: cache on and off compute the same context in different batches (~1e-6 apart)
SYSTEM = (
    "<|im_start|>system\nYou are a careful Python assistant. Write short, correct code with docstrings. "
    "Prefer the standard library. Explain each step in one sentence.<|im_end|>\n"
)
QUESTIONS = ["def fibonacci(n):", "class Stack:\n    def", "import os\nimport sys\n\n", "for i in range("]
QUESTIONS += ["def is_prime(n):", "Sort a list of numbers", "What does len() do?", "The quick brown fox"]


def ids(pair, text: str) -> list[int]:
    """`text` through the pair's tokenizer, or (no tokenizer) ids drawn from a seed that is the text's CRC."""
    if pair.has_tokenizer:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(pair.target / "tokenizer.json")).encode(text).ids
    vocab = json.loads((pair.target / "config.json").read_text())["vocab_size"]
    rng = random.Random(zlib.crc32(text.encode()))
    return [rng.randrange(vocab - 1) for _ in range(max(1, len(text) // 3))]


def chat(pair, question: str) -> list[int]:
    return ids(pair, SYSTEM) + ids(pair, f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", False), **kw)


def run_until(engine, reqs) -> None:
    while not all(r.finished for r in reqs):
        engine.step()


def first_then_together(prompts: list[list[int]], max_tokens: int):
    """A flow: prompts[0] runs to its end (its blocks cached), then every other prompt is added at once."""

    def flow(engine):
        first = engine.add_request(prompts[0], params(max_tokens))
        run_until(engine, [first])
        reqs = [first] + [engine.add_request(p, params(max_tokens)) for p in prompts[1:]]
        run_until(engine, reqs)
        return reqs

    return flow


def record_drafts(engine) -> tuple[dict[int, list[tuple[int, list[int]]]], dict[int, torch.Tensor]]:
    """Every draft the proposer makes, per request: (position of the current token, drafts); and the logits
    of each request's first draft (its first use of the context a hit brings) [B-1, V]."""
    log: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
    first: dict[int, torch.Tensor] = {}
    propose, logits = engine.proposer.propose, engine.proposer.propose_logits

    def logged(items):
        out = propose(items)
        for it, d in zip(items, out):
            log[it.req_id].append((it.start, list(d)))
        return out

    def logged_logits(items, fp32=True):
        out = logits(items, fp32=fp32)
        for it, row in zip(items, out):
            first.setdefault(it.req_id, row.float().clone())
        return out

    engine.proposer.propose, engine.proposer.propose_logits = logged, logged_logits
    return log, first


def run_both(pair, flow, draft=True, broken=None, **kw):
    """flow(engine) -> requests, on a cache-off and a cache-on engine (`broken`: a context manager patching
    the cache-on engine's run). Returns {False: (engine, requests, drafts), True: ...}."""
    out = {}
    for cache in (False, True):
        engine = cpu_engine(pair.target, pair.draft if draft else None, enable_prefix_caching=cache, **kw)
        drafts = record_drafts(engine) if engine.proposer is not None else ({}, {})
        if cache and broken is not None:
            with broken():
                out[cache] = (engine, flow(engine), drafts)
        else:
            out[cache] = (engine, flow(engine), drafts)
    return out


def mismatches(runs) -> list[str]:
    """The acceptance-equality gate: per request, accepted lengths per verify step, drafts per draft step and
    the first draft's logits (within LOGITS_TOL: a drafter that proposes one token whatever its context, as
    the tiny random pair's does, leaves the first two blind), cache on vs off. Outputs: _check, first."""
    (_, off, (d_off, l_off)), (_, on, (d_on, l_on)) = runs[False], runs[True]
    bad = []
    for i, (a, b) in enumerate(zip(off, on)):
        ca, cb = a.spec.committed_per_step, b.spec.committed_per_step
        j = first_divergence(cb, ca)
        if j is not None:
            bad.append(
                f"request {i} (cached {b.cached_tokens} tokens): accepted lengths diverge at verify step {j}: "
                f"on {cb[max(0, j - 2) : j + 3]} off {ca[max(0, j - 2) : j + 3]}; tau on {b.spec.tau:.3f} "
                f"off {a.spec.tau:.3f}"
            )
        da, db = d_off.get(a.request_id, []), d_on.get(b.request_id, [])
        j = first_divergence(db, da)
        if j is not None and j < min(len(da), len(db)):
            bad.append(f"request {i}: drafts diverge at draft {j} (position {da[j][0]}): on {db[j][1]} off {da[j][1]}")
        la, lb = l_off.get(a.request_id), l_on.get(b.request_id)
        if la is not None and lb is not None:
            delta = (la - lb).abs().max().item()
            if delta > LOGITS_TOL:
                bad.append(f"request {i}: first draft's logits differ by max |delta| {delta:.3e} (tol {LOGITS_TOL})")
    return bad


def check(runs, label: str) -> list:
    """Outputs equal token for token and the acceptance gate passes; the cache-on requests."""
    (_, off, _), (engine, on, _) = runs[False], runs[True]
    for i, (a, b) in enumerate(zip(off, on)):
        assert b.reject_reason is None, f"{label} request {i}: {b.message}"
        assert_same_tokens(b.output_ids, a.output_ids, f"{label} request {i} (cached {b.cached_tokens} tokens)")
    bad = mismatches(runs)
    assert not bad, f"{label}: acceptance gate FAIL, cache on vs off:\n" + "\n".join(bad)
    assert engine.pool.allocator.num_free == engine.pool.num_blocks, f"{label}: blocks leaked"
    return on
