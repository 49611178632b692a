"""Shadow probes (refengine/spec_decode/shadow_probe.py) are lossless and measure what a verify would: a plain
choice's probes draft their block beside the decode step, and the longest prefix of those drafts that the
tokens decoded next match is the accepted count the policy learns. Checked on every fixture pair, eager and
in graph mode (the CPU's fake graphs): outputs equal plain decoding, no probe runs a verify, the drafts and
the accepted count equal fixed DFlash's first verify at the same position, a failed shadow step is rolled
back and probed again, and the bench's acceptance profiles report a draw for the shadow's span.

Run: pytest tests/golden/test_lossless_shadow.py     (or: pytest -k "lossless and shadow")
"""

from __future__ import annotations

import gc

import pytest

from refengine import SamplingParams
from tests.adapter import assert_same_tokens, cpu_engine, greedy
from tests.golden.test_lossless import B, _check_clean, _prompts
from tests.golden.test_lossless_adaptive import _adaptive_at_tau1, _seed_plain_regime


def _shadow_engine(pair, graph_mode: str, max_num_seqs: int, make=cpu_engine, **kw):
    """An adaptive engine (`make`: CPU, or tests.adapter.gpu_engine) with shadow probes on, both cost curves
    given (no calibration verify), no exploration, and fixed costs at which plain wins: what drafts is the
    probes, every one a shadow."""
    engine = make(
        pair.target,
        pair.draft,
        speculation="adaptive",
        shadow_probes=True,
        graph_mode=graph_mode,
        max_num_seqs=max_num_seqs,
        **kw,
    )
    policy = engine.scheduler.policy
    assert policy is not None and engine.scheduler.shadow_probes
    _seed_plain_regime(policy)
    policy._next_explore = 10**9
    return engine, policy


def _logged(engine, policy) -> tuple[list, list]:
    """Every shadow answer (req, span, accepted) and every shadow step's drafts (items, drafts)."""
    answers: list[tuple[int, int, int]] = []
    drafted: list[tuple[list, list]] = []
    observe, read = policy.observe_shadow, engine.runner.shadow.read

    def observe_logged(req_id: int, span: int, accepted: int) -> None:
        answers.append((req_id, span, accepted))
        observe(req_id, span, accepted)

    def read_logged(proposer, items):
        out = read(proposer, items)
        drafted.append((list(items), out))
        return out

    policy.observe_shadow = observe_logged
    engine.runner.shadow.read = read_logged
    return answers, drafted


@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_lossless_shadow_probes(model_pair, graph_mode):
    """Probes and re-probes of a batch of two, every one a shadow: outputs equal plain decoding, no verify step
    runs, and each answer is the longest prefix of its drafts that the request's plain output matches."""
    run_shadow_lossless(model_pair, graph_mode, cpu_engine)


def run_shadow_lossless(model_pair, graph_mode: str, make) -> None:
    """test_lossless_shadow_probes on engines of `make` (the GPU test runs it with CUDA graphs)."""
    from refengine.spec_decode.exploration import REPROBE_EVERY

    prompts = _prompts(model_pair, 4, seed=12)
    budgets = [REPROBE_EVERY + 30 + 5 * i for i in range(len(prompts))]
    plain = greedy(make(model_pair.target), prompts, budgets, True)
    engine, policy = _shadow_engine(model_pair, graph_mode, max_num_seqs=2, make=make)
    answers, drafted = _logged(engine, policy)
    choose, decisions = policy.choose, []

    def choose_logged(req_ids, remaining):
        spans = choose(req_ids, remaining)
        decisions.append((policy.last.cap, len(policy.probed)))
        return spans

    policy.choose = choose_logged
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, budgets)]
    while engine.has_work():
        engine.step()
    for i, (r, ref) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, ref, f"{model_pair.name} shadow-probed request {i} (max_tokens {budgets[i]})")
    # a verify runs only where the choice speculates (the trained pair's loops); every probe of a plain choice
    # is a shadow, first-step probes and re-probes alike
    speculating = sum(cap > 1 for cap, _ in decisions)
    assert engine.scheduler.plan_counts["verify"] == speculating, (dict(engine.scheduler.plan_counts), speculating)
    assert policy.shadows == sum(k for cap, k in decisions if cap == 1) >= len(prompts), policy.summary()
    assert policy.reprobes > 0 or speculating, policy.summary()
    assert len(answers) == policy.shadows and not policy.in_flight, (answers, policy.in_flight)
    by_id = {r.request_id: (len(p), ref) for r, p, ref in zip(reqs, prompts, plain)}
    expect = []
    for items, outs in drafted:
        for it, d in zip(items, outs):
            prompt_len, ref = by_id[it.req_id]
            got = ref[it.start - prompt_len + 1 :][: len(d)]
            m = next((k for k, (a, b) in enumerate(zip(d, got)) if a != b), len(got))
            expect.append((it.req_id, it.span if m < len(got) or m == len(d) else m + 1, m))
    assert sorted(answers) == sorted(expect), f"shadow answers {answers} against the drafts' matches {expect}"
    _check_clean(engine)


@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_shadow_probe_measures_what_a_verify_accepts(model_pair, graph_mode):
    """A request's first-step probe as a shadow drafts what fixed DFlash's first verify drafts (same position,
    same block) and reports the accepted count that verify found, prompt by prompt."""
    run_shadow_vs_verify(model_pair, graph_mode, cpu_engine)


def _draft_log(engine) -> list:
    """The drafts the engine's lane proposes, step by step (the verify then takes the host path)."""
    log: list = []
    propose = engine.scheduler.proposer.propose

    def logged(items):
        log.append(propose(items))
        return log[-1]

    engine.scheduler.proposer.propose = logged
    return log


def run_shadow_vs_verify(model_pair, graph_mode: str, make) -> list[int]:
    """test_shadow_probe_measures_what_a_verify_accepts on engines of `make`; the verifies' accepted counts."""
    prompts = _prompts(model_pair, 6, seed=13)
    found = []
    for i, p in enumerate(prompts):
        fixed = make(model_pair.target, model_pair.draft, graph_mode=graph_mode)
        fixed_drafts = _draft_log(fixed)
        r = fixed.add_request(p, SamplingParams(max_tokens=3 * B, ignore_eos=True))
        fixed.step()  # the prefill: one token
        fixed.step()  # the first verify, a full block
        m_verify = len(r.output_ids) - 2
        engine, policy = _shadow_engine(model_pair, graph_mode, max_num_seqs=1, make=make)
        answers, drafted = _logged(engine, policy)
        engine.add_request(p, SamplingParams(max_tokens=3 * B, ignore_eos=True))
        while not answers:
            engine.step()
        shadow = drafted[0][1]
        assert shadow == fixed_drafts[0], f"prompt {i}: shadow drafts {shadow}, the verify's {fixed_drafts[0]}"
        assert answers[0][1:] == (B, m_verify), f"prompt {i}: shadow (span, m) {answers[0][1:]}, verify m {m_verify}"
        found.append(m_verify)
        del fixed, engine, policy  # (the logs' closures make cycles: collect before the next pair of engines)
        gc.collect()
    if model_pair.name == "tiny-trained":
        assert max(found) > 0, f"the trained pair's first blocks accepted nothing on these prompts: {found}"
    return found


def test_a_failed_shadow_step_is_rolled_back_and_probed_again(random_pair):
    """A shadow step whose drafting raises fails like any step: rolled back, its request no longer awaits an
    answer, and the next step probes it again; the output still equals plain decoding."""
    prompts = _prompts(random_pair, 1, seed=14)
    plain = greedy(cpu_engine(random_pair.target), prompts, [24], True)
    engine, policy = _shadow_engine(random_pair, "eager", max_num_seqs=1)
    read, failed = engine.runner.shadow.read, []

    def read_once_failing(proposer, items):
        if not failed:
            failed.append(items)
            raise RuntimeError("injected: the shadow draft failed")
        return read(proposer, items)

    engine.runner.shadow.read = read_once_failing
    r = engine.add_request(prompts[0], SamplingParams(max_tokens=24, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert failed and policy.shadows == 2 and not policy.in_flight, policy.summary()
    assert_same_tokens(r.output_ids, plain[0], "the request whose shadow step failed once")
    assert r.failed_steps == 1
    _check_clean(engine)


def test_shadow_probes_under_an_acceptance_profile_draw_for_their_span(random_pair):
    """Under the bench's profiles (outputs not greedy-exact: nothing to compare) a shadow's answer is drawn for
    its span at once, as a verify's m would be; tau1.0 draws 0, and outputs equal plain decoding."""
    prompts = _prompts(random_pair, 3, seed=15)
    plain = greedy(cpu_engine(random_pair.target), prompts, [30] * 3, True)
    engine, policy = _adaptive_at_tau1(random_pair, "eager", 3, shadow_probes=True)
    _seed_plain_regime(policy)
    policy._next_explore = 10**9
    answers, _ = _logged(engine, policy)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
        assert not engine.scheduler.shadows.open, "a profile's shadow answer waits for nothing"
    assert answers and all(m == 0 and s > 1 for _, s, m in answers), answers
    for i, (r, ref) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, ref, f"tau1.0 shadow-probed request {i}")
    _check_clean(engine)


def test_a_shadow_steps_time_stays_out_of_the_plain_cost_samples(random_pair):
    """A shadow step's time (its decode and the draft beside it) goes to the runner's `shadow_s`, never to
    `decode_s`, which the adaptive policy's plain cost samples read: counted there, each shadow made the next
    sample's decode step look dearer (the trained tiny pair's P(16) read 1.09 ms for a 0.7 ms step on the
    H200, and adaptive speculated at a loss)."""
    prompts = _prompts(random_pair, 2, seed=16)
    engine, policy = _shadow_engine(random_pair, "full", max_num_seqs=2)
    timings, kinds = engine.runner.timings, []
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_work():
        before = dict(timings)
        engine.step()
        plan = engine.last_plan
        grew = {k for k in ("decode_s", "shadow_s") if timings[k] > before[k]}
        if getattr(plan, "shadow", ()):
            kinds.append("shadow")
            assert grew == {"shadow_s"}, f"a shadow step's time went to {grew}"
        elif type(plan).__name__ == "DecodePlan":
            kinds.append("decode")
            assert grew == {"decode_s"}, f"a decode step's time went to {grew}"
    assert "shadow" in kinds and "decode" in kinds, kinds
    assert engine.scheduler.plan_counts["shadow"] == kinds.count("shadow"), (dict(engine.scheduler.plan_counts), kinds)
