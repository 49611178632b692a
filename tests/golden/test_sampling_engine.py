"""Sampling in the engine (temperature > 0): reproducible and batch-invariant, and greedy untouched.

On the trained tiny pair (real acceptance) and, with REFENGINE_TARGET_PATH / REFENGINE_DRAFT_PATH set, the
real pair, CPU fp32: 24 requests of mixed settings (temperature 0.6 and 1.0, top-k, top-p, sampled and
greedy drafts) give the same tokens when run again, when each runs alone, in every graph mode, when another
request's verify step fails after its forward and is rolled back, and when their prompts come from the
prefix cache; temperature 0 with top-k / top-p / seed set is exactly the greedy output; speculative sampling
commits more than one token per verify step on the trained pair (drafts get accepted) with either kind of
draft. Failures print the request and its first divergent position.

    PYTHONPATH=. python -m pytest tests/golden/test_sampling_engine.py -q -p no:cacheprovider
"""

from __future__ import annotations

import random

import pytest

from conftest import model_pairs
from refengine import SamplingParams
from tests.adapter import assert_same_tokens, cpu_engine
from tests.faults import FaultInjector

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=0.8, top_k=20),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_k=50, top_p=0.8),
    dict(temperature=0.0),  # greedy requests ride along in the same batches
]


def workload(n: int = 24) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(48)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(2, 14))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(8, 40), seed=1000 + i, ignore_eos=True, **SETTINGS[i % len(SETTINGS)])
        for i in range(n)
    ]
    return prompts, params


def outputs(pair, prompts, params, **kw) -> list[list[int]]:
    engine = cpu_engine(pair.target, pair.draft, **kw)
    return [r.output_ids for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module", params=["sampled", "greedy"])
def reference(request, sampling_pair):
    prompts, params = workload()
    return request.param, prompts, params, outputs(sampling_pair, prompts, params, draft_sampling=request.param)


@pytest.fixture(
    scope="module", params=[p for p in model_pairs() if p.name in ("tiny-trained", "real")], ids=lambda p: p.name
)
def sampling_pair(request):
    return request.param


def assert_all_same(got: list[list[int]], want: list[list[int]], label: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_tokens(g, w, f"{label}, request {i}")


def test_same_seed_same_tokens_again_and_alone(reference, sampling_pair):
    mode, prompts, params, want = reference
    assert_all_same(outputs(sampling_pair, prompts, params, draft_sampling=mode), want, f"{mode} drafts, again")
    for i in (0, 3, 4):
        alone = outputs(sampling_pair, prompts[i : i + 1], params[i : i + 1], draft_sampling=mode)
        assert_same_tokens(alone[0], want[i], f"{mode} drafts, request {i} alone")


@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_every_graph_mode_gives_the_same_tokens(reference, sampling_pair, graph_mode):
    mode, prompts, params, want = reference
    got = outputs(sampling_pair, prompts, params, draft_sampling=mode, graph_mode=graph_mode)
    assert_all_same(got, want, f"{mode} drafts, graph mode {graph_mode}")


def test_a_rolled_back_step_redraws_the_same_tokens(reference, sampling_pair):
    mode, prompts, params, want = reference
    engine = cpu_engine(sampling_pair.target, sampling_pair.draft, draft_sampling=mode)
    inj = FaultInjector(engine, "verify", at=4, after=True)  # the forward wrote KV and features, then failed
    got = [r.output_ids for r in engine.generate(prompts, params)]
    assert inj.fired == 1 and inj.affected, "the fault never fired"
    assert_all_same(got, want, f"{mode} drafts, after a rolled-back verify")


def test_temperature_zero_is_greedy_whatever_else_is_set(sampling_pair):
    prompts, _ = workload(8)
    plain = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts]
    knobs = [SamplingParams(max_tokens=24, ignore_eos=True, top_k=3, top_p=0.5, seed=i) for i in range(8)]
    assert_all_same(outputs(sampling_pair, prompts, knobs), outputs(sampling_pair, prompts, plain), "T = 0 + knobs")


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_sampled_verify_accepts_drafts(trained_pair, mode):
    prompts, _ = workload(16)
    params = [SamplingParams(max_tokens=32, temperature=0.6, seed=i, ignore_eos=True) for i in range(16)]
    engine = cpu_engine(trained_pair.target, trained_pair.draft, draft_sampling=mode)
    stats = engine.spec_stats(engine.generate(prompts, params))
    assert stats.tau > 1.0, f"{mode} drafts at T 0.6: tau {stats.tau:.3f} over {stats.verify_steps} verify steps"


def test_prefix_cache_hits_draw_the_same_tokens(reference, sampling_pair):
    """The second run of the same prompts on one engine takes their full blocks from the prefix cache: the
    prefill runs only past them, and its first token and every later one are drawn as without the cache."""
    mode, prompts, params, want = reference
    prompts = [p * 3 for p in prompts]  # long enough to fill whole KV blocks
    engine = cpu_engine(sampling_pair.target, sampling_pair.draft, draft_sampling=mode, enable_prefix_caching=True)
    cold = [r.output_ids for r in engine.generate(prompts, params)]
    warm = engine.generate(prompts, params)
    assert sum(r.cached_tokens for r in warm) > 0, "no request took a cached block"
    assert_all_same([r.output_ids for r in warm], cold, f"{mode} drafts, prefix-cache hits")
    plain = cpu_engine(sampling_pair.target, sampling_pair.draft, draft_sampling=mode)
    assert_all_same(cold, [r.output_ids for r in plain.generate(prompts, params)], f"{mode} drafts, cache on vs off")
