"""Prefix caching on CUDA (bf16, FlashInfer, the graph mode REFENGINE_GRAPH_MODE names; marked `gpu`): a
shared system prompt, then multi-turn chats, on an engine with the prefix cache off and one with it on. With
the cache on, a prompt's prefix K/V and tap features come from another request's forward, so bf16 sums in
another order than the cache-off engine's own prefill: outputs are gated by the first-divergence regret gate
(re-anchored: tie flips pass, a misplaced block does not), and acceptance by tau with the cache on over tau
with it off (>= MIN_TAU_RATIO; a hit that skips the drafter's context loses far more on the trained pair).
The later requests must have hit (Request.cached_tokens).

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_prefix_cache.py
"""

from __future__ import annotations

import pytest

from golden.gates import MARGIN_TOL, first_divergence_regret_gate
from refengine import SamplingParams
from tests.adapter import gpu_engine, score_sequences
from tests.prefix_scenarios import PAGE, QUESTIONS, SYSTEM, chat, ids

pytestmark = pytest.mark.gpu
MIN_TAU_RATIO = 0.9


def _flow(engine, pair):
    """A shared system prompt (one request first, then seven together), then two more turns of three chats."""
    params = SamplingParams(max_tokens=48, ignore_eos=not pair.has_tokenizer)
    first = engine.add_request(chat(pair, QUESTIONS[0]), params)
    while not first.finished:
        engine.step()
    reqs = [first] + [engine.add_request(chat(pair, q), params) for q in QUESTIONS[1:]]
    while engine.has_work():
        engine.step()
    chats = reqs[:3]
    for turn in ("Now add type hints.", "And a test."):
        user = ids(pair, f"<|im_end|>\n<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n")
        chats = [engine.add_request(list(r.prompt_ids) + r.output_ids + user, params) for r in chats]
        while engine.has_work():
            engine.step()
        reqs += chats
    return reqs


def test_gpu_prefix_cache_lossless_and_acceptance(model_pair):
    runs = {}
    for cache in (False, True):
        engine = gpu_engine(model_pair.target, model_pair.draft, enable_prefix_caching=cache)
        engine.capture_graphs()
        runs[cache] = (engine, _flow(engine, model_pair))
    (off_engine, off), (engine, on) = runs[False], runs[True]
    engine.check_integrity()
    shared = len(ids(model_pair, SYSTEM)) // PAGE * PAGE
    cached = [r.cached_tokens for r in on]
    assert cached[0] == 0 and all(c >= shared for c in cached[1:]), f"cached tokens {cached} (system {shared})"

    def score(ids):
        return score_sequences(engine, [("rescore", ids[:-1], ids[-1:])])[0]

    # the turns' prompts hold each engine's own earlier outputs: gate each request against the cache-off
    # engine's output for the same prompt where the prompts are equal, and on its own prompt otherwise
    reports = []
    for i, (a, b) in enumerate(zip(off, on)):
        if a.prompt_ids != b.prompt_ids:
            continue  # an earlier turn diverged (at a gated tie): the prompts differ from here on
        reports.append(
            first_divergence_regret_gate(
                list(b.prompt_ids), a.output_ids, b.output_ids, score, tol=MARGIN_TOL, reanchor=True, name=f"req-{i}"
            )
        )
    print(
        f"\n[{model_pair.name}] cached {cached}; "
        + "; ".join(f"{r.name}: div {r.first_divergence} regret {r.first_regret:.3f}" for r in reports)
    )
    assert len(reports) >= len(QUESTIONS), f"only {len(reports)} requests had equal prompts"
    for r in reports:
        r.assert_passes()
    tau_off, tau_on = off_engine.spec_stats(off).tau, engine.spec_stats(on).tau
    assert tau_on >= MIN_TAU_RATIO * tau_off, f"tau with the cache {tau_on:.3f}, without {tau_off:.3f}"
