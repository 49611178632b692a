"""Span choice is lossless: whatever span a policy picks per request per step (1 = plain decode for that
request, a one-row span with no drafts), the greedy output equals plain decoding token for token. Checked with
GoodputSpans (speculation="adaptive") on every fixture pair in eager and graph modes, with the oracle and
garbage test proposers (which drive it to full spans and to span 1), and with a test policy drawing spans at
random every step through the graph modes on the CPU (steps where one request drafts and the rest decode
replay verify shapes of fewer rows per request than B; steps where every span is 1 replay the decode graph,
taps included): the graph-path faults the graph unit tests miss. KV integrity and drafter alignment hold
after every step and every scenario.

Run: pytest tests/golden/test_lossless_adaptive.py     (or: pytest -k lossless)
"""

from __future__ import annotations

import random

import pytest

from refengine import SamplingParams
from tests.adapter import assert_no_leftovers, assert_same_tokens, cpu_engine, greedy
from tests.golden.test_lossless import BUDGETS, B, _ignore_eos, _prompts
from tests.proposers import garbage, oracle
from tests.span_policies import ScriptedSpans, random_spans


@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_lossless_adaptive_dflash_concurrent(model_pair, graph_mode):
    prompts = _prompts(model_pair, 10, seed=5)
    budgets = [BUDGETS[i % len(BUDGETS)] for i in range(len(prompts))]
    ign = _ignore_eos(model_pair)
    plain = greedy(cpu_engine(model_pair.target), prompts, budgets, ign)
    engine = cpu_engine(model_pair.target, model_pair.draft, speculation="adaptive", graph_mode=graph_mode)
    spec = greedy(engine, prompts, budgets, ign)
    for i, (s, p) in enumerate(zip(spec, plain)):
        assert_same_tokens(s, p, f"{model_pair.name} adaptive {graph_mode} request {i} (max_tokens {budgets[i]})")
    stats = engine.span_stats()
    assert stats["policy"] == "adaptive" and stats["errors"] == 0 and stats["spans"], stats
    assert_no_leftovers(engine, f"{model_pair.name} adaptive {graph_mode}")


def _run_checked(pair, proposer, prompts, budgets, **kw):
    """Every request's output equals plain greedy; integrity after every step; nothing left after."""
    engine = cpu_engine(pair.target, proposer=proposer, **kw)
    plain = greedy(cpu_engine(pair.target), prompts, budgets, True)
    reqs = []
    for p, m, ref in zip(prompts, budgets, plain):
        r = engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        proposer.expect(r.request_id, len(p), ref)
        reqs.append(r)
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    for i, (r, ref) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, ref, f"request {i} (max_tokens {budgets[i]})")
    assert_no_leftovers(engine)
    return engine, reqs


@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_lossless_adaptive_oracle_and_garbage_proposers(random_pair, graph_mode):
    """An oracle drafter (every draft accepted) makes GoodputSpans speculate; a garbage one (none accepted)
    makes it fall back to span 1. Outputs are plain greedy's either way."""
    prompts = _prompts(random_pair, 7, seed=6)
    engine, _ = _run_checked(
        random_pair, oracle(B, 1024), prompts, BUDGETS, speculation="adaptive", graph_mode=graph_mode
    )
    spans = {int(k): v for k, v in engine.span_stats()["spans"].items()}
    assert max(spans) > 1, f"oracle acceptance should make the policy speculate: spans {spans}"
    engine, _ = _run_checked(
        random_pair, garbage(B, 1024), prompts, BUDGETS, speculation="adaptive", graph_mode=graph_mode
    )
    spans = {int(k): v for k, v in engine.span_stats()["spans"].items()}
    assert spans.get(1, 0) > 0, f"garbage acceptance should make the policy fall back to span 1: spans {spans}"


@pytest.mark.parametrize("graph_mode", ["eager", "piecewise", "full"])
def test_lossless_adaptive_random_spans_every_step(random_pair, graph_mode):
    """Random spans per request per step, steps where every span is 1 (the decode graph with taps), and steps
    where one request drafts while the rest decode (verify shapes of few rows per request)."""
    rng = random.Random(7)
    prompts = _prompts(random_pair, 7, seed=8)

    def script(step, ids, remaining):
        u = rng.random()
        if u < 0.3:
            return [1] * len(ids)
        if u < 0.55:
            spans = [1] * len(ids)
            spans[rng.randrange(len(spans))] = B
            return spans
        return [rng.randint(1, B) for _ in ids]

    engine, reqs = _run_checked(
        random_pair, oracle(B, 1024), prompts, BUDGETS, span_policy=ScriptedSpans(B, script), graph_mode=graph_mode
    )
    spans = {int(k) for k in engine.span_stats()["spans"]}
    assert 1 in spans and len(spans) > 5, spans
    if graph_mode != "eager":  # mixed spans replay verify shapes of fewer rows per request than B
        caps = {cap for _, cap in engine.runner.graphs["verify"].graphs}
        assert len(caps) > 1, f"every verify step replayed one row cap: {caps}"


@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_lossless_random_spans_real_drafter_truncated_budgets(model_pair, graph_mode):
    """The real drafter with random spans, budgets ending inside a block (truncated spans), requests joining
    mid-flight: equal to plain greedy, and the drafter's context stays aligned through long runs of span 1
    (its rows are caught up when it drafts again)."""
    prompts = _prompts(model_pair, 6, seed=11)
    budgets = [3, B - 1, B + 2, 2 * B + 5, 9, 40]
    ign = _ignore_eos(model_pair)
    plain = greedy(cpu_engine(model_pair.target), prompts, budgets, ign)
    policy = random_spans(B, seed=3, plain_share=0.5)
    engine = cpu_engine(model_pair.target, model_pair.draft, span_policy=policy, graph_mode=graph_mode)
    reqs = [engine.add_request(prompts[0], SamplingParams(max_tokens=budgets[0], ignore_eos=ign))]
    for p, m in zip(prompts[1:], budgets[1:]):
        engine.step()
        engine.check_integrity()
        reqs.append(engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=ign)))
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    for i, (r, ref) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, ref, f"{model_pair.name} {graph_mode} request {i}")
    assert any(max(rep.spans) == 1 for rep in policy.reports) and any(max(rep.spans) > 1 for rep in policy.reports)
    assert_no_leftovers(engine, f"{model_pair.name} random spans")
