"""Adaptive speculation is lossless: whatever span the policy picks per request per step (1 = plain decode for
that request, verified as a one-row span with no drafts), the greedy output equals plain decoding token for
token, with the real drafter on every fixture pair, with the oracle and garbage test proposers (which drive
the policy to full spans and to span 1), with spans drawn at random every step, and through retirements
(after a first block, passed over, or after a re-probe in a small batch). KV integrity and drafter alignment
hold after every scenario.

Run: pytest tests/golden/test_lossless_adaptive.py     (or: pytest -k lossless)
"""

from __future__ import annotations

import random

import pytest

from refengine import SamplingParams
from refengine.plan import DecodePlan
from tests.adapter import assert_same_tokens, cpu_engine, greedy
from tests.golden.test_lossless import BUDGETS, B, _check_clean, _ignore_eos, _prompts
from tests.proposers import garbage, oracle


def test_lossless_adaptive_dflash_concurrent(model_pair):
    prompts = _prompts(model_pair, 10, seed=5)
    budgets = [BUDGETS[i % len(BUDGETS)] for i in range(len(prompts))]
    ign = _ignore_eos(model_pair)
    plain = greedy(cpu_engine(model_pair.target), prompts, budgets, ign)
    engine = cpu_engine(model_pair.target, model_pair.draft, speculation="adaptive")
    spec = greedy(engine, prompts, budgets, ign)
    for i, (s, p) in enumerate(zip(spec, plain)):
        assert_same_tokens(s, p, f"{model_pair.name} adaptive request {i} (max_tokens {budgets[i]})")
    assert engine.scheduler.policy is not None and engine.scheduler.policy.steps > 0
    _check_clean(engine)


def _adaptive_with(pair, proposer, prompts, budgets, choose=None, **kw):
    engine = cpu_engine(pair.target, proposer=proposer, speculation="adaptive", **kw)
    if choose is not None:
        engine.scheduler.policy.choose = choose  # type: ignore[union-attr]
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
    _check_clean(engine)
    return engine, reqs


def test_lossless_adaptive_oracle_and_garbage_proposers(random_pair):
    prompts = _prompts(random_pair, 7, seed=6)
    _, reqs = _adaptive_with(random_pair, oracle(B, 1024), prompts, BUDGETS)
    hist = sum((r.spec.span_hist for r in reqs), start=type(reqs[0].spec.span_hist)())
    assert max(hist) > 1, f"oracle acceptance should make the policy speculate: spans {dict(hist)}"
    _, reqs = _adaptive_with(random_pair, garbage(B, 1024), prompts, BUDGETS)
    hist = sum((r.spec.span_hist for r in reqs), start=type(reqs[0].spec.span_hist)())
    assert hist[1] > 0, f"garbage acceptance should make the policy fall back to span 1: spans {dict(hist)}"


@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_lossless_adaptive_random_spans_every_step(random_pair, graph_mode):
    """Random spans per request per step, steps where one request speculates and the rest decode (graph modes:
    a verify shape of fewer rows per request than B), and steps where every span is 1 (then the runner
    replays the one-row decode graph, taps included)."""
    rng = random.Random(7)
    prompts = _prompts(random_pair, 7, seed=8)

    def choose(req_ids, remaining):
        u = rng.random()
        if u < 0.3:
            return [1] * len(req_ids)
        if u < 0.55:  # one request speculates, the rest decode: a verify shape of few rows per request
            spans = [1] * len(req_ids)
            spans[rng.randrange(len(spans))] = B
            return spans
        return [rng.randint(1, B) for _ in req_ids]

    engine, reqs = _adaptive_with(random_pair, oracle(B, 1024), prompts, BUDGETS, choose, graph_mode=graph_mode)
    spans = set().union(*(r.spec.span_hist for r in reqs))
    assert 1 in spans and len(spans) > 5, spans
    if graph_mode != "eager":  # mixed spans replay verify shapes of fewer rows per request than B
        caps = {cap for _, cap in engine.runner.graphs["verify"].graphs}
        assert len(caps) > 1, f"every verify step replayed one row cap: {caps}"


def _seed_position_one_failing(policy, n: int = 40) -> None:
    """Evidence that position 1 fails in first and later blocks alike: n past requests whose first block and
    one later block each accepted nothing (ids the engine never gives)."""
    for rid in range(-1, -n - 1, -1):
        policy.observe_acceptance(rid, B, 0)  # its first block
        policy.observe_acceptance(rid, B, 0)  # a later one
        policy.release(rid)


def _seed_plain_regime(policy, n: int = 40) -> None:
    """Evidence of a workload whose first and later blocks accept position 1 in 30% of blocks (never position 1
    failing), a plain regime (the last decision to speculate long ago) and fixed costs at which plain wins
    for a batch of any size (the simulation's, never updated: the device's own step times would decide
    otherwise)."""
    from refengine.spec_decode.adaptive import RETIRE_AFTER
    from refengine.spec_decode.step_costs import CostModel

    for k, rid in enumerate(range(-1, -n - 1, -1)):
        accepted = int(k % 10 < 3)
        policy.observe_acceptance(rid, B, accepted)  # its first block
        policy.observe_acceptance(rid, B, accepted)  # a later one
        policy.release(rid)
    policy.cost = CostModel.linear(5e-3, 1e-5, 8e-6, 1.2e-3, 7e-5, p0=4.6e-3, p1=1.2e-5)
    policy.cost.observe = lambda *args, **kw: None  # type: ignore[method-assign]
    policy.cost.plain.updates = policy.cost.verify.updates = 1  # both curves given: no calibration step
    policy._spec_at = -RETIRE_AFTER


def _seed_dormant(policy) -> None:
    """A dormant policy (refengine/spec_decode/dormancy.py): _seed_plain_regime's fixed costs (the credit's
    arithmetic then does not hang on the device's timings), then a workload where position 1 fails everywhere,
    no exploration due, and DORMANT_AFTER calm first blocks in both kinds of batch."""
    from refengine.spec_decode.dormancy import DORMANT_AFTER

    _seed_plain_regime(policy)
    _seed_position_one_failing(policy, n=80)
    policy._next_explore = 10**9
    policy.dormancy.calm = [DORMANT_AFTER] * 2


def _adaptive_at_tau1(model_pair, graph_mode: str, max_num_seqs: int, **kw):
    """An adaptive CPU engine of the pair whose verifies accept nothing (the bench's tau1.0 profile: each commits
    exactly the target's greedy token, so outputs must equal plain decoding), and its policy. `kw`: more
    EngineConfig fields."""
    from refengine.config import EngineConfig
    from refengine.engine import Engine
    from refengine.spec_decode.acceptance_profile import AcceptanceOverride, parse_profile

    config = EngineConfig(
        str(model_pair.target),
        draft_path=str(model_pair.draft),
        device="cpu",
        speculation="adaptive",
        graph_mode=graph_mode,
        max_num_seqs=max_num_seqs,
        **kw,
    )
    engine = Engine(config, acceptance_override=AcceptanceOverride(parse_profile("tau1.0")))
    assert engine.scheduler.policy is not None
    return engine, engine.scheduler.policy


@pytest.mark.parametrize("regime", ["calibrating", "sampled", "plain-regime"])
@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_lossless_adaptive_retired_requests(model_pair, graph_mode, regime):
    """The policy retires requests from speculation. While position 1 fails everywhere: after their own block
    failed (`calibrating`: the policy's first steps draft for every request to measure the verify curve), or
    passed over by the probe sample once a sampled first block failed too (`sampled`: both cost curves
    measured, so only every PROBE_SAMPLE-th new request is probed). In a plain regime where position 1 still
    accepts (`plain-regime`: a workload like the bench's tau 1.3 profile, where plain wins at every batch
    size): the same two ways, a probe in line with the workload standing for a failed one. They keep decoding
    in the same steps at span 1 without a drafter context, and a batch of retired requests runs the decode
    graph without taps. The real drafter drafts; the bench's tau1.0 profile makes every verify accept nothing,
    which commits exactly the target's greedy token, so the output must still equal plain decoding."""
    from refengine.spec_decode.probe_sample import PROBE_SAMPLE

    prompts = _prompts(model_pair, 12, seed=9)
    budgets = [BUDGETS[i % len(BUDGETS)] + 20 for i in range(len(prompts))]
    plain = greedy(cpu_engine(model_pair.target), prompts, budgets, True)
    engine, policy = _adaptive_at_tau1(model_pair, graph_mode, max_num_seqs=12)
    if regime == "plain-regime":
        _seed_plain_regime(policy)
    else:
        _seed_position_one_failing(policy)
    measured = regime != "calibrating"
    if measured:
        policy.cost.plain.updates = policy.cost.verify.updates = 1  # no calibration step
        policy._next_explore = 10**9  # and no exploration: what retires is the sample and the probes
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, budgets)]
    released = []
    while engine.has_work():
        engine.step()
        live = engine.scheduler.active_proposer.live_requests()
        released.append(sum(1 for r in engine.scheduler.running if r.request_id not in live))
    for i, (r, ref) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, ref, f"{model_pair.name} retired-path request {i} (max_tokens {budgets[i]})")
    assert policy.retirements == len(prompts), f"{policy.retirements} of {len(prompts)} requests retired"
    steps = [(r.spec.committed_tokens, r.spec.verify_steps, len(r.output_ids) - 1) for r in reqs]
    assert all(c == v == n for c, v, n in steps), f"stats (tokens, steps, decoded) per request: {steps}"
    assert regime != "plain-regime" or not policy._position_one_fails(), "the workload accepts position 1"
    if measured:  # only every PROBE_SAMPLE-th new request is probed (position 1 failing, or a plain regime)
        sampled = -(-len(prompts) // PROBE_SAMPLE)
        assert (policy.probes, policy.unprobed) == (sampled, len(prompts) - sampled), policy.summary()
    assert max(released) == len(prompts), f"running requests without a drafter context per step: {released}"
    if graph_mode != "eager":
        tapless = engine.runner.graphs["decode_plain"].replays
        assert tapless > 0, "a batch of retired requests should replay the decode graph without taps"
    _check_clean(engine)


@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_lossless_adaptive_retired_after_a_reprobe(model_pair, graph_mode):
    """In a batch of fewer than PROBE_SAMPLE, a request in a plain regime retires only after a re-probe of its own
    (refengine/spec_decode/retirement.py): it drafts its first block, decodes plainly writing taps, drafts again
    past a catch-up of the rows since, then retires mid-generation (its drafter context freed, later steps
    without taps). The bench's tau1.0 profile makes every verify accept nothing, so the output must equal plain
    decoding; every retirement came after the request's re-probe."""
    from refengine.spec_decode.exploration import REPROBE_EVERY

    prompts = _prompts(model_pair, 4, seed=11)
    budgets = [2 * REPROBE_EVERY + 20 + 7 * i for i in range(len(prompts))]
    plain = greedy(cpu_engine(model_pair.target), prompts, budgets, True)
    engine, policy = _adaptive_at_tau1(model_pair, graph_mode, max_num_seqs=2)
    _seed_plain_regime(policy)
    policy._next_explore = 10**9  # no exploration: what drafts is the probes and the re-probes
    retire = policy.sample.retire
    early: list[int] = []  # requests retired before a re-probe of their own

    def checked(req_id: int, why: str = "") -> None:
        if req_id not in policy.reprobed:
            early.append(req_id)
        retire(req_id, why)

    policy.sample.retire = checked  # type: ignore[method-assign]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, budgets)]
    while engine.has_work():
        engine.step()
    for i, (r, ref) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, ref, f"{model_pair.name} re-probed request {i} (max_tokens {budgets[i]})")
    assert policy.reprobes > 0 and policy.retirements > 0, policy.summary()
    assert not early, f"requests {early} retired before a re-probe of their own: {policy.summary()['retired_by']}"
    _check_clean(engine)


@pytest.mark.parametrize("graph_mode", ["eager", "full"])
def test_lossless_adaptive_dormant_admission(model_pair, graph_mode, monkeypatch):
    """A dormant policy (refengine/spec_decode/dormancy.py: calm first blocks in a position-1-fails regime)
    admits new requests retired: their prefill captures nothing, they never hold a drafter context and decode
    on plain decode's own step, except the probes the admitted work pays for (DORMANT_SHARE raised here so a
    few requests pay for one), which draft beside them. The bench's tau1.0 profile makes every verify accept
    nothing, so every output must equal plain decoding, and every request's stats count each decode step. A batch
    of retired requests only is planned again without a look at each while it holds (Scheduler._retired_batch)."""
    from refengine.spec_decode import dormancy

    monkeypatch.setattr(dormancy, "DORMANT_SHARE", 0.02)
    prompts = _prompts(model_pair, 12, seed=13)
    budgets = [BUDGETS[i % len(BUDGETS)] + 20 for i in range(len(prompts))]
    plain = greedy(cpu_engine(model_pair.target), prompts, budgets, True)
    engine, policy = _adaptive_at_tau1(model_pair, graph_mode, max_num_seqs=4)
    _seed_dormant(policy)
    admit, retired_at_admission = policy.admit, []

    def recorded(req_id: int, *args) -> bool:
        out = admit(req_id, *args)
        if out:
            retired_at_admission.append(req_id)
        return out

    policy.admit = recorded  # type: ignore[method-assign]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, budgets)]
    unlooked = 0  # steps planned from a held all-retired batch (Scheduler._retired_batch), without a look
    while engine.has_work():
        held_batch = engine.scheduler._retired_batch
        engine.step()
        same = held_batch is not None and engine.scheduler._retired_batch is held_batch
        unlooked += same and isinstance(engine.last_plan, DecodePlan)
        held = engine.scheduler.active_proposer.live_requests() & set(retired_at_admission)
        assert not held, f"requests {sorted(held)}, admitted retired, hold a drafter context"
    assert unlooked > 0, "no all-retired batch was planned again without a look at each request"
    for i, (r, ref) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, ref, f"{model_pair.name} dormant request {i} (max_tokens {budgets[i]})")
    summary = policy.summary()["dormant"]
    assert summary["admitted"] == len(retired_at_admission) > 0 and summary["probes"] > 0, summary
    assert summary["admitted"] + summary["probes"] == len(prompts), summary
    steps = [(r.spec.committed_tokens, r.spec.verify_steps, len(r.output_ids) - 1) for r in reqs]
    assert all(c == v == n for c, v, n in steps), f"stats (tokens, steps, decoded) per request: {steps}"
    if graph_mode != "eager":
        assert engine.runner.graphs["decode_plain"].replays > 0, "retired batches replay the tapless decode graph"
    _check_clean(engine)
