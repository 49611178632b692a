"""Prefix caching under DFlash is lossless and keeps speculation paying, on CPU fp32: every scenario runs on
an engine with the prefix cache off and one with it on, and per request the outputs must be equal token for
token and the acceptance-equality gate must pass (tests/prefix_scenarios.py: accepted lengths of every verify
step, Request.spec.committed_per_step, the drafts of every draft step and the first draft's logits), so a hit
that skips or misplaces the drafter's context fails even where the output stays lossless
(tests/golden/test_prefix_cache_gate.py shows it on two broken engines). Scenarios: many requests sharing a
system prompt (staggered), multi-turn chats (the next turn hits the last turn's generated blocks),
partial-block hits, a prefix evicted and refilled while a long request runs, concurrent first requests racing
for one prefix, blocks cached by requests that did not draft (no tap features: a drafting request must not
take them), a plain engine. Integrity (reference counts, the cache's blocks) is checked after every step
(conftest).

Run: pytest tests/golden/test_lossless_prefix_cache.py      (a real pair too with REFENGINE_TARGET_PATH /
REFENGINE_DRAFT_PATH set)
"""

from __future__ import annotations

import pytest

from tests.prefix_scenarios import (
    PAGE,
    QUESTIONS,
    SYSTEM,
    chat,
    check,
    first_then_together,
    ids,
    params,
    run_both,
    run_until,
)


def test_lossless_prefix_cache_shared_system_prompt(model_pair):
    prompts = [chat(model_pair, q) for q in QUESTIONS]

    def flow(engine):
        first = engine.add_request(prompts[0], params(24))
        run_until(engine, [first])
        reqs = [first]
        for p in prompts[1:]:  # staggered: each joins while the earlier ones run
            reqs.append(engine.add_request(p, params(24)))
            engine.step()
        run_until(engine, reqs)
        return reqs

    on = check(run_both(model_pair, flow), "shared system prompt")
    shared = len(ids(model_pair, SYSTEM)) // PAGE * PAGE
    got = [r.cached_tokens for r in on]
    assert got[0] == 0 and all(c >= shared for c in got[1:]), f"cached tokens {got}: each later request >= {shared}"


def test_lossless_prefix_cache_multi_turn(model_pair):
    """Each next turn's prompt is the last turn's prompt + output + a new user message: it must hit every
    whole block the last turn committed, generated ones included."""
    turns = ["Write a function.", "Now add type hints.", "And a test."]

    def flow(engine):
        prompts = [chat(model_pair, q) for q in QUESTIONS[:3]]
        committed = [0] * len(prompts)  # tokens with KV the last turn left (all but its last token)
        reqs = []
        for t, text in enumerate(turns):
            wave = [engine.add_request(p, params(16)) for p in prompts]
            run_until(engine, wave)
            got, want = [r.cached_tokens for r in wave], [c // PAGE * PAGE for c in committed]
            assert not engine.config.enable_prefix_caching or got == want, f"turn {t}: cached {got}, want {want}"
            user = ids(model_pair, f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
            committed = [r.num_tokens - 1 for r in wave]
            prompts = [list(r.prompt_ids) + r.output_ids + user for r in wave]
            reqs += wave
        return reqs

    check(run_both(model_pair, flow), "multi-turn")


def test_lossless_prefix_cache_partial_blocks(model_pair):
    base = chat(model_pair, QUESTIONS[0])
    cut = 2 * PAGE + 7  # later prompts share the first 39 tokens: two whole blocks and 7 of a third
    others = [base[:cut] + ids(model_pair, q) for q in QUESTIONS[1:4]]

    def flow(engine):
        first = engine.add_request(base[: 3 * PAGE], params(8))  # exactly three blocks
        run_until(engine, [first])
        again = engine.add_request(base[: 3 * PAGE], params(8))  # all cached: its last block still runs
        reqs = [first, again] + [engine.add_request(p, params(12)) for p in others]
        run_until(engine, reqs)
        return reqs

    on = check(run_both(model_pair, flow), "partial blocks")
    got = [r.cached_tokens for r in on]
    assert got == [0, 2 * PAGE] + [2 * PAGE] * 3, f"cached tokens {got}, want [0, 32, 32, 32, 32]"


def test_lossless_prefix_cache_evicted_and_refilled(model_pair):
    """A 20-block pool: a long request (5 blocks) and a filler (15) evict the first chat's cached blocks; the
    next chat recomputes and re-registers them while the long request runs, and the one after hits them."""
    a, c, d = (chat(model_pair, q) for q in QUESTIONS[:3])
    long_prompt, filler = ids(model_pair, "x = 1\n" * 10)[:20], ids(model_pair, "# filler line\n" * 80)[:230]

    def flow(engine):
        ra = engine.add_request(a, params(6))
        run_until(engine, [ra])
        long = engine.add_request(long_prompt, params(60, ignore_eos=True))
        engine.step()
        fill = engine.add_request(filler, params(8, ignore_eos=True))
        run_until(engine, [fill])
        rc = engine.add_request(c, params(6))
        run_until(engine, [rc])
        assert not long.finished, "the long request must still run when the refilled prefix is hit"
        rd = engine.add_request(d, params(6))
        run_until(engine, [rd, long])
        return [ra, long, fill, rc, rd]

    runs = run_both(model_pair, flow, num_blocks=20)
    ra, _, _, rc, rd = check(runs, "evicted and refilled")
    stats = runs[True][0].prefix_cache_stats()
    assert stats["evicted"] > 0, f"nothing was evicted: {stats}"
    shared = len(ids(model_pair, SYSTEM)) // PAGE * PAGE
    assert rc.cached_tokens < shared <= rd.cached_tokens, (
        f"cached tokens: after the eviction {rc.cached_tokens}, after the refill {rd.cached_tokens} "
        f"(system prompt: {shared} in whole blocks)"
    )


@pytest.mark.parametrize("prefill_tokens", [8192, 72])
def test_lossless_prefix_cache_racing_first_requests(model_pair, prefill_tokens):
    """Six requests for one new prefix submitted together: in one prefill (none can hit: nothing is
    committed yet; every copy is computed, one registered) or one prefill each (later ones hit)."""
    prompts = [chat(model_pair, q) for q in QUESTIONS[:6]]

    def flow(engine):
        reqs = [engine.add_request(p, params(12)) for p in prompts]
        run_until(engine, reqs)
        return reqs

    runs = run_both(model_pair, flow, max_prefill_tokens=prefill_tokens)
    got = [r.cached_tokens for r in check(runs, f"racing, max_prefill_tokens {prefill_tokens}")]
    one_prefill = prefill_tokens >= sum(map(len, prompts))
    assert (not any(got)) if one_prefill else (got[0] == 0 and all(got[1:])), f"cached tokens {got}"


def test_lossless_prefix_cache_featureless_blocks(model_pair):
    """A logprobs request (it does not draft) caches a prefix without tap features: a drafting request must
    not take those blocks, another logprobs request may; the drafting request's own copies replace them."""
    p = [chat(model_pair, q) for q in QUESTIONS[:4]]

    def flow(engine):
        reqs = []
        for prompt, logprobs in zip(p, (2, 0, 2, 0)):
            reqs.append(engine.add_request(prompt, params(10, logprobs=logprobs)))
            run_until(engine, reqs)
        return reqs

    got = [r.cached_tokens for r in check(run_both(model_pair, flow), "featureless blocks")]
    assert got[0] == 0 and got[1] == 0 and got[2] > 0 and got[3] > 0, f"cached tokens {got}, want [0, 0, >0, >0]"


def test_lossless_prefix_cache_plain_engine(model_pair):
    flow = first_then_together([chat(model_pair, q) for q in QUESTIONS[:5]], 16)
    got = [r.cached_tokens for r in check(run_both(model_pair, flow, draft=False), "plain engine")]
    assert got[0] == 0 and all(got[1:]), f"cached tokens {got}"
