"""Prefix caching under DFlash is lossless and keeps speculation paying, on CPU fp32: every scenario runs on
an engine with the prefix cache off and one with it on, and per request the outputs must be equal token for
token, the accepted lengths of every verify step (Request.spec.committed_per_step) equal, and the drafts
proposed at every draft step equal, so a hit that skips or misplaces the drafter's context fails even
where the output stays lossless. Scenarios: many requests sharing a system prompt (staggered), multi-turn
chats (the next turn hits the last turn's generated blocks), partial-block hits, a prefix evicted and
refilled while a long request runs, concurrent first requests racing for one prefix, blocks cached by
requests that did not draft (no tap features: a drafting request must not take them), a plain engine. Two
deliberately broken engines (a hit's drafter context skipped; featureless blocks taken, with the flag that
lets check_integrity name it gone too) show the gate fails on exactly those bugs while their outputs stay
lossless. Integrity (reference counts, the cache's
blocks) is checked after every step (conftest).

Run: pytest tests/golden/test_lossless_prefix_cache.py      (a real pair too with REFENGINE_TARGET_PATH /
REFENGINE_DRAFT_PATH set)
"""

from __future__ import annotations

import json
import random
import zlib
from collections import defaultdict
from unittest.mock import patch

import pytest
import torch

from refengine import SamplingParams
from refengine.spec_decode.lane import DFlashLane
from tests.adapter import assert_same_tokens, cpu_engine, first_divergence

PAGE = 16
LOGITS_TOL = 1e-3  # fp32: cache on and off compute the same context in different batches (~1e-6 apart)
SYSTEM = (
    "<|im_start|>system\nYou are a careful Python assistant. Write short, correct code with docstrings. "
    "Prefer the standard library. Explain each step in one sentence.<|im_end|>\n"
)
QUESTIONS = ["def fibonacci(n):", "class Stack:\n    def", "import os\nimport sys\n\n", "for i in range("]
QUESTIONS += ["def is_prime(n):", "Sort a list of numbers", "What does len() do?", "The quick brown fox"]


def _ids(pair, text: str) -> list[int]:
    """`text` through the pair's tokenizer, or (no tokenizer) ids drawn from a seed that is the text's CRC."""
    if pair.has_tokenizer:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(pair.target / "tokenizer.json")).encode(text).ids
    vocab = json.loads((pair.target / "config.json").read_text())["vocab_size"]
    rng = random.Random(zlib.crc32(text.encode()))
    return [rng.randrange(vocab - 1) for _ in range(max(1, len(text) // 3))]


def _chat(pair, question: str) -> list[int]:
    return _ids(pair, SYSTEM) + _ids(pair, f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def _params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", False), **kw)


def _run_until(engine, reqs) -> None:
    while not all(r.finished for r in reqs):
        engine.step()


def _record_drafts(engine) -> tuple[dict[int, list[tuple[int, list[int]]]], dict[int, torch.Tensor]]:
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


def _run_both(pair, flow, draft=True, broken=None, **kw):
    """flow(engine) -> requests, on a cache-off and a cache-on engine (`broken`: a context manager patching
    the cache-on engine's run). Returns {False: (engine, requests, drafts), True: ...}."""
    out = {}
    for cache in (False, True):
        engine = cpu_engine(pair.target, pair.draft if draft else None, enable_prefix_caching=cache, **kw)
        drafts = _record_drafts(engine) if engine.proposer is not None else ({}, {})
        if cache and broken is not None:
            with broken():
                out[cache] = (engine, flow(engine), drafts)
        else:
            out[cache] = (engine, flow(engine), drafts)
    return out


def _mismatches(runs) -> list[str]:
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


def _check(runs, label: str) -> list:
    """Outputs equal token for token and the acceptance gate passes; the cache-on requests."""
    (_, off, _), (engine, on, _) = runs[False], runs[True]
    for i, (a, b) in enumerate(zip(off, on)):
        assert b.reject_reason is None, f"{label} request {i}: {b.message}"
        assert_same_tokens(b.output_ids, a.output_ids, f"{label} request {i} (cached {b.cached_tokens} tokens)")
    bad = _mismatches(runs)
    assert not bad, f"{label}: acceptance gate FAIL, cache on vs off:\n" + "\n".join(bad)
    assert engine.pool.allocator.num_free == engine.pool.num_blocks, f"{label}: blocks leaked"
    return on


def test_lossless_prefix_cache_shared_system_prompt(model_pair):
    prompts = [_chat(model_pair, q) for q in QUESTIONS]

    def flow(engine):
        first = engine.add_request(prompts[0], _params(24))
        _run_until(engine, [first])
        reqs = [first]
        for p in prompts[1:]:  # staggered: each joins while the earlier ones run
            reqs.append(engine.add_request(p, _params(24)))
            engine.step()
        _run_until(engine, reqs)
        return reqs

    on = _check(_run_both(model_pair, flow), "shared system prompt")
    shared = len(_ids(model_pair, SYSTEM)) // PAGE * PAGE
    got = [r.cached_tokens for r in on]
    assert got[0] == 0 and all(c >= shared for c in got[1:]), f"cached tokens {got}: each later request >= {shared}"


def test_lossless_prefix_cache_multi_turn(model_pair):
    """Each next turn's prompt is the last turn's prompt + output + a new user message: it must hit every
    whole block the last turn committed, generated ones included."""
    turns = ["Write a function.", "Now add type hints.", "And a test."]

    def flow(engine):
        prompts = [_chat(model_pair, q) for q in QUESTIONS[:3]]
        committed = [0] * len(prompts)  # tokens with KV the last turn left (all but its last token)
        reqs = []
        for t, text in enumerate(turns):
            wave = [engine.add_request(p, _params(16)) for p in prompts]
            _run_until(engine, wave)
            got, want = [r.cached_tokens for r in wave], [c // PAGE * PAGE for c in committed]
            assert not engine.config.enable_prefix_caching or got == want, f"turn {t}: cached {got}, want {want}"
            user = _ids(model_pair, f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
            committed = [r.num_tokens - 1 for r in wave]
            prompts = [list(r.prompt_ids) + r.output_ids + user for r in wave]
            reqs += wave
        return reqs

    _check(_run_both(model_pair, flow), "multi-turn")


def test_lossless_prefix_cache_partial_blocks(model_pair):
    base = _chat(model_pair, QUESTIONS[0])
    cut = 2 * PAGE + 7  # later prompts share the first 39 tokens: two whole blocks and 7 of a third
    others = [base[:cut] + _ids(model_pair, q) for q in QUESTIONS[1:4]]

    def flow(engine):
        first = engine.add_request(base[: 3 * PAGE], _params(8))  # exactly three blocks
        _run_until(engine, [first])
        again = engine.add_request(base[: 3 * PAGE], _params(8))  # all cached: its last block still runs
        reqs = [first, again] + [engine.add_request(p, _params(12)) for p in others]
        _run_until(engine, reqs)
        return reqs

    on = _check(_run_both(model_pair, flow), "partial blocks")
    got = [r.cached_tokens for r in on]
    assert got == [0, 2 * PAGE] + [2 * PAGE] * 3, f"cached tokens {got}, want [0, 32, 32, 32, 32]"


def test_lossless_prefix_cache_evicted_and_refilled(model_pair):
    """A 20-block pool: a long request (5 blocks) and a filler (15) evict the first chat's cached blocks; the
    next chat recomputes and re-registers them while the long request runs, and the one after hits them."""
    a, c, d = (_chat(model_pair, q) for q in QUESTIONS[:3])
    long_prompt, filler = _ids(model_pair, "x = 1\n" * 10)[:20], _ids(model_pair, "# filler line\n" * 80)[:230]

    def flow(engine):
        ra = engine.add_request(a, _params(6))
        _run_until(engine, [ra])
        long = engine.add_request(long_prompt, _params(60, ignore_eos=True))
        engine.step()
        fill = engine.add_request(filler, _params(8, ignore_eos=True))
        _run_until(engine, [fill])
        rc = engine.add_request(c, _params(6))
        _run_until(engine, [rc])
        assert not long.finished, "the long request must still run when the refilled prefix is hit"
        rd = engine.add_request(d, _params(6))
        _run_until(engine, [rd, long])
        return [ra, long, fill, rc, rd]

    runs = _run_both(model_pair, flow, num_blocks=20)
    ra, _, _, rc, rd = _check(runs, "evicted and refilled")
    stats = runs[True][0].prefix_cache_stats()
    assert stats["evicted"] > 0, f"nothing was evicted: {stats}"
    shared = len(_ids(model_pair, SYSTEM)) // PAGE * PAGE
    assert rc.cached_tokens < shared <= rd.cached_tokens, (
        f"cached tokens: after the eviction {rc.cached_tokens}, after the refill {rd.cached_tokens} "
        f"(system prompt: {shared} in whole blocks)"
    )


@pytest.mark.parametrize("prefill_tokens", [8192, 72])
def test_lossless_prefix_cache_racing_first_requests(model_pair, prefill_tokens):
    """Six requests for one new prefix submitted together: in one prefill (none can hit: nothing is
    committed yet; every copy is computed, one registered) or one prefill each (later ones hit)."""
    prompts = [_chat(model_pair, q) for q in QUESTIONS[:6]]

    def flow(engine):
        reqs = [engine.add_request(p, _params(12)) for p in prompts]
        _run_until(engine, reqs)
        return reqs

    runs = _run_both(model_pair, flow, max_prefill_tokens=prefill_tokens)
    got = [r.cached_tokens for r in _check(runs, f"racing, max_prefill_tokens {prefill_tokens}")]
    one_prefill = prefill_tokens >= sum(map(len, prompts))
    assert (not any(got)) if one_prefill else (got[0] == 0 and all(got[1:])), f"cached tokens {got}"


def test_lossless_prefix_cache_featureless_blocks(model_pair):
    """A logprobs request (it does not draft) caches a prefix without tap features: a drafting request must
    not take those blocks, another logprobs request may; the drafting request's own copies replace them."""
    p = [_chat(model_pair, q) for q in QUESTIONS[:4]]

    def flow(engine):
        reqs = []
        for prompt, logprobs in zip(p, (2, 0, 2, 0)):
            reqs.append(engine.add_request(prompt, _params(10, logprobs=logprobs)))
            _run_until(engine, reqs)
        return reqs

    got = [r.cached_tokens for r in _check(_run_both(model_pair, flow), "featureless blocks")]
    assert got[0] == 0 and got[1] == 0 and got[2] > 0 and got[3] > 0, f"cached tokens {got}, want [0, 0, >0, >0]"


def test_lossless_prefix_cache_plain_engine(model_pair):
    prompts = [_chat(model_pair, q) for q in QUESTIONS[:5]]

    def flow(engine):
        first = engine.add_request(prompts[0], _params(16))
        _run_until(engine, [first])
        reqs = [first] + [engine.add_request(p, _params(16)) for p in prompts[1:]]
        _run_until(engine, reqs)
        return reqs

    got = [r.cached_tokens for r in _check(_run_both(model_pair, flow, draft=False), "plain engine")]
    assert got[0] == 0 and all(got[1:]), f"cached tokens {got}"


# ---- negative controls: the gate fails on exactly the bugs it exists for ------------------------------------


def _skip_cached_context(self, req_id: int, rows: int) -> None:
    self._ctx[req_id].length += rows  # claimed projected, never projected: the drafter reads stale pages


def _concurrent_chats(pair):
    prompts = [_chat(pair, q) for q in QUESTIONS]

    def flow(engine):
        first = engine.add_request(prompts[0], _params(24))
        _run_until(engine, [first])
        reqs = [first] + [engine.add_request(p, _params(24)) for p in prompts[1:]]
        _run_until(engine, reqs)
        return reqs

    return flow


def test_gate_fails_a_hit_that_skips_the_drafter_context(model_pair):
    runs = _run_both(
        model_pair,
        _concurrent_chats(model_pair),
        broken=lambda: patch.object(DFlashLane, "attach_cached", _skip_cached_context),
    )
    (_, off, _), (_, on, _) = runs[False], runs[True]
    for i, (a, b) in enumerate(zip(off, on)):  # still lossless: only the gate below sees it
        assert_same_tokens(b.output_ids, a.output_ids, f"broken engine request {i}")
    bad = _mismatches(runs)
    assert bad, "the acceptance gate passed an engine whose hits skip the drafter context"
    print("expected failure:\n" + "\n".join(bad[:4]))


def test_gate_fails_a_drafting_hit_on_featureless_blocks(model_pair):
    """A port without the per-block features flag: drafting requests take blocks a logprobs request cached.
    check_integrity names it at the first such hit; with the flag gone altogether, the gate fails."""
    from contextlib import ExitStack

    from refengine.errors import IntegrityError
    from refengine.kv.pool import KvPool
    from refengine.kv.prefix_cache import PrefixCache

    lookup = KvPool.lookup

    def any_block(self, prompt_len, keys, need_features):
        return lookup(self, prompt_len, keys, False)

    def flow(engine):
        first = engine.add_request(_chat(model_pair, QUESTIONS[0]), _params(16, logprobs=2))
        _run_until(engine, [first])
        reqs = [first] + [engine.add_request(_chat(model_pair, q), _params(24)) for q in QUESTIONS[1:5]]
        _run_until(engine, reqs)
        return reqs

    with patch.object(KvPool, "lookup", any_block), pytest.raises(IntegrityError, match="tap features"):
        flow(cpu_engine(model_pair.target, model_pair.draft, enable_prefix_caching=True))

    def no_flag():
        stack = ExitStack()
        stack.enter_context(patch.object(KvPool, "lookup", any_block))
        stack.enter_context(patch.object(PrefixCache, "lacks_features", lambda self, block: False))
        return stack

    runs = _run_both(model_pair, flow, broken=no_flag)
    assert all(r.cached_tokens for r in runs[True][1][1:]), "the broken engine must hit the featureless blocks"
    bad = _mismatches(runs)
    assert bad, "the acceptance gate passed drafting requests that took blocks without tap features"
    print("expected failure:\n" + "\n".join(bad[:4]))
