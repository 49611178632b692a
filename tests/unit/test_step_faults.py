"""Engine.step is a transaction: a fault in a prefill, decode or verify forward, in the draft, in feature
staging, in the drafter-context allocation at admission, or a malformed result, rolls the whole plan back
(KV extends, speculative reservations, staged features, admissions); the step's requests are retried once
and finish with FinishReason.ERROR (the exception in the message) if their second step fails too. A fault
inside commit finishes the plan's unfinished requests with ERROR. In every case step() does not raise, every
other request produces exactly its bs=1 output, new requests are served, integrity holds after every step
(conftest) and the pool drains to fully free. The same around adaptive requests retired from speculation. A
failing adaptive choice decodes that step plainly and the engine goes on.
Also: check_integrity names the disagreements it must catch.

Run: python -m pytest -q tests/unit/test_step_faults.py
"""

from __future__ import annotations

import pytest

from refengine import FinishReason, RequestStatus, SamplingParams
from refengine.errors import IntegrityError, StepError
from refengine.plan import StepResult
from refengine.spec_decode.step_costs import CostModel
from tests.adapter import assert_same_tokens, cpu_engine, greedy
from tests.faults import FaultInjector

PROMPTS = [[5, 9, 13, 2, 7] * 3, [101, 7, 8] * 6, [3] * 16, [44, 45, 46, 47] * 8]
BUDGETS = [12, 20, 5, 17]


@pytest.fixture(scope="module")
def refs(random_pair) -> list[list[int]]:
    return [greedy(cpu_engine(random_pair.target, max_num_seqs=1), [p], m)[0] for p, m in zip(PROMPTS, BUDGETS)]


def _engine(pair, draft=True, **kw):
    return cpu_engine(pair.target, pair.draft if draft else None, num_blocks=kw.pop("num_blocks", 20), **kw)


def _add(engine, i, logprobs=0):
    return engine.add_request(PROMPTS[i], SamplingParams(max_tokens=BUDGETS[i], ignore_eos=True, logprobs=logprobs))


def _drain(engine, limit=200):
    for _ in range(limit):
        if not engine.has_work():
            break
        engine.step()  # never raises
    assert not engine.has_work(), f"still working after {limit} steps"
    assert engine.pool.allocator.num_free == engine.pool.num_blocks, "KV blocks leaked"
    if engine.proposer is not None:
        assert engine.proposer.live_requests() == set(), "drafter contexts leaked"


def _adaptive_at_tau1(pair):
    """An adaptive CPU engine whose verifies accept nothing (the bench's tau1.0 profile: each commits the
    target's own greedy token, so outputs stay exact), and its policy."""
    from refengine import Engine, EngineConfig
    from refengine.spec_decode.acceptance_profile import AcceptanceOverride, parse_profile

    config = EngineConfig(str(pair.target), draft_path=str(pair.draft), device="cpu", speculation="adaptive")
    engine = Engine(config, acceptance_override=AcceptanceOverride(parse_profile("tau1.0")))
    assert engine.scheduler.policy is not None
    return engine, engine.scheduler.policy


def _exact(reqs, refs, idx):
    for r, i in zip(reqs, idx):
        assert r.finish_reason is FinishReason.LENGTH, f"request {r.request_id}: {r.finish_reason} {r.message}"
        assert_same_tokens(r.output_ids, refs[i], f"request {r.request_id} (prompt {i})")


def test_decode_fault_once_is_rolled_back_and_retried(random_pair, refs):
    engine = _engine(random_pair, draft=False)
    inj = FaultInjector(engine, "decode", at=2, after=True)  # the forward wrote KV, then failed
    reqs = [_add(engine, i) for i in range(3)]
    _drain(engine)
    assert inj.fired == 1
    _exact(reqs, refs, range(3))
    late = _add(engine, 3)
    _drain(engine)
    _exact([late], refs, [3])


def test_decode_fault_twice_finishes_the_step_with_error_others_go_on(random_pair, refs):
    engine = _engine(random_pair)
    inj = FaultInjector(engine, "decode", at=1, times=2)
    plain = [_add(engine, i, logprobs=2) for i in (0, 1)]  # ineligible: decode plans
    spec = _add(engine, 2)  # speculating: verify plans, untouched
    _drain(engine)
    assert inj.fired == 2
    for r in plain:
        assert r.finish_reason is FinishReason.ERROR and r.status is RequestStatus.FINISHED
        assert "2 steps it was part of failed" in r.message, r.message
        assert "InjectedFault: injected fault at decode call 2" in r.message, r.message
        assert r in engine.finished
    _exact([spec], refs, [2])
    late = _add(engine, 3, logprobs=2)
    _drain(engine)
    _exact([late], refs, [3])


def test_prefill_fault_once_requeues_in_order_holding_nothing(random_pair, refs):
    engine = _engine(random_pair, max_num_seqs=2)
    inj = FaultInjector(engine, "prefill", at=0, after=True)
    reqs = [_add(engine, 0), _add(engine, 1, logprobs=2), _add(engine, 2)]
    assert engine.step() == [] and inj.fired == 1
    assert [r.request_id for r in engine.scheduler.waiting] == [0, 1, 2], "the failed prefill must go back first"
    assert all(r.status is RequestStatus.WAITING for r in reqs) and engine.has_work()
    assert engine.pool.allocator.num_free == engine.pool.num_blocks and engine.proposer.live_requests() == set()
    _drain(engine)
    _exact(reqs, refs, range(3))


def test_prefill_fault_twice_finishes_with_error_not_running_forever(random_pair, refs):
    engine = _engine(random_pair)
    FaultInjector(engine, "prefill", at=0, times=2)
    reqs = [_add(engine, 0), _add(engine, 1, logprobs=2)]
    engine.step()
    done = engine.step()
    assert done == reqs, "the second failed prefill finishes its requests"
    for r in reqs:
        assert r.finish_reason is FinishReason.ERROR and r.output_ids == [], (r.finish_reason, r.output_ids)
        assert "prefill step of 2 requests, raised InjectedFault" in r.message, r.message
    assert not engine.has_work()
    _drain(engine)
    late = _add(engine, 2)
    _drain(engine)
    _exact([late], refs, [2])


@pytest.mark.parametrize("point,after", [("draft", False), ("draft", True), ("verify", True), ("stage", True)])
def test_speculative_fault_once_is_lossless(random_pair, refs, point, after):
    engine = _engine(random_pair)
    inj = FaultInjector(engine, point, at=2 if point == "stage" else 1, after=after)
    reqs = [_add(engine, i) for i in range(3)] + [_add(engine, 3, logprobs=2)]
    _drain(engine)
    assert inj.fired == 1
    _exact(reqs, refs, range(4))


@pytest.mark.parametrize("point,at,after", [("decode", 0, False), ("decode", 2, True), ("verify", 0, True)])
def test_faults_around_retired_requests_are_lossless(random_pair, refs, point, at, after):
    """Adaptive requests retired from speculation (no drafter context, span 1, rows not captured): a fault in
    their decode step (plain decode's own) or in the probe step of a newcomer they ride along in (a verify
    with uncaptured rows) rolls back and retries like any other; the outputs stay exact, their stats
    complete, nothing leaks."""
    from tests.golden.test_lossless_adaptive import _seed_position_one_failing

    engine, policy = _adaptive_at_tau1(random_pair)
    _seed_position_one_failing(policy)
    policy.cost.plain.updates = policy.cost.verify.updates = 1  # no calibration: probes, then retirement
    policy._next_explore = 10**9
    reqs = [_add(engine, i) for i in range(3)]
    while policy.retirements < 3:  # each probed (a batch under PROBE_SAMPLE), failed, retired
        engine.step()
    inj = FaultInjector(engine, point, at=at, after=after)
    reqs.append(_add(engine, 3))  # a newcomer: its probe verifies beside the retired requests
    _drain(engine)
    assert inj.fired == 1 and policy.retirements == 4, (inj.fired, policy.summary())
    if point == "verify":  # the newcomer's probe, with every unfinished retired request riding along
        assert len(inj.affected) > 1, f"the failed plan held {sorted(inj.affected)}"
    _exact(reqs, refs, range(4))
    steps = [(r.spec.verify_steps, len(r.output_ids) - 1) for r in reqs]
    assert all(v == n for v, n in steps), f"stats (steps, decoded) per request: {steps}"


def test_a_failing_policy_choice_decodes_plainly_and_the_engine_goes_on(random_pair, refs):
    """The adaptive policy's choice runs in the schedule, outside the step's transaction: an exception there (a
    bug in it) used to stop the engine. Now that step decodes plainly (spans never change a greedy output), the
    failure is logged and counted, and the engine goes on: outputs exact, nothing leaks."""
    engine, policy = _adaptive_at_tau1(random_pair)
    # costs fixed (no calibration, no learning from this CPU's timings) with plain winning: every new request's
    # first choice probes it. On learnt CPU costs whether a choice probed depended on the timings (in 3 of 6 runs
    # none did, and no choice failed)
    fixed = CostModel.linear(20e-3, 1e-5, 8e-6, 1.2e-3, 7e-5, p0=4.6e-3, p1=1.2e-5)
    policy.cost.verify, policy.cost.draft, policy.cost.plain = fixed.verify, fixed.draft, fixed.plain
    policy.cost.plain.updates = policy.cost.verify.updates = 1
    policy.observe_step = lambda *a, **k: None  # type: ignore[method-assign]
    policy.cost.observe_host = lambda *a, **k: None  # type: ignore[method-assign]
    policy._next_explore = 10**9
    choose, calls, left_probed, probing = policy.choose, [0], [], [0]

    def sometimes_broken(req_ids, remaining):
        calls[0] += 1
        spans = choose(req_ids, remaining)  # (its state changed, as a choice failing late leaves it)
        probing[0] += bool(policy.probed)
        if policy.probed and policy.errors < 2:  # the first two choices that probe someone fail
            raise KeyError(12345)  # as a released drafter context's lookup did (twenty-third session)
        return spans

    sched_choose = engine.scheduler._choose

    def watched(spec, remaining):
        errors = policy.errors
        spans = sched_choose(spec, remaining)
        if policy.errors > errors:
            left_probed.append(list(policy.probed))  # a failed choice's probes, left for shadowable to read
        return spans

    policy.choose = sometimes_broken  # type: ignore[method-assign]
    engine.scheduler._choose = watched  # type: ignore[method-assign]
    reqs = [_add(engine, i) for i in range(4)]
    _drain(engine)
    assert policy.errors == 2 and policy.summary()["errors"] == 2, (calls, policy.summary()["errors"])
    assert left_probed == [[], []], f"probes left after failed choices: {left_probed}"
    assert probing[0] >= 3, f"{probing[0]} choices probed: the failed choices' requests were not probed again"
    _exact(reqs, refs, range(4))


def test_prefill_fault_undoes_a_dormant_admission(random_pair, refs):
    """A dormant adaptive policy (refengine/spec_decode/dormancy.py) retires new requests as they are admitted;
    a prefill that fails takes that back with the rest of the admission (no retired request waits, the
    scheduler's stats hold nothing for them), and the retry admits them again: exact outputs, nothing leaks."""
    from tests.golden.test_lossless_adaptive import _seed_dormant

    engine, policy = _adaptive_at_tau1(random_pair)
    _seed_dormant(policy)
    inj = FaultInjector(engine, "prefill", at=0, after=True)
    reqs = [_add(engine, i) for i in range(3)]
    assert engine.step() == [] and inj.fired == 1
    assert policy.dormancy.admitted == 3, policy.summary()["dormant"]
    assert policy.retired == set() and engine.scheduler.retired_at == {}, "a failed admission holds no retirement"
    assert [r.request_id for r in engine.scheduler.waiting] == [0, 1, 2]
    _drain(engine)
    assert policy.dormancy.admitted == 6 and policy.retirements == 6, policy.summary()
    _exact(reqs, refs, range(3))
    steps = [(r.spec.verify_steps, len(r.output_ids) - 1) for r in reqs]
    assert all(v == n for v, n in steps), f"stats (steps, decoded) per request: {steps}"


def test_commit_fault_errors_only_its_plan(random_pair, refs):
    engine = _engine(random_pair)
    inj = FaultInjector(engine, "commit", at=4)  # calls 0-2: prefill of 0, 1, 2; 3-4: the verify of 0 and 1
    spec = [_add(engine, 0), _add(engine, 1)]
    plain = _add(engine, 2, logprobs=2)
    _drain(engine)
    assert inj.fired == 1 and inj.affected == {0, 1}
    for r in spec:
        assert r.finish_reason is FinishReason.ERROR, (r.request_id, r.finish_reason)
        assert "internal error in a step of 2 requests (a refengine bug, not retried): InjectedFault" in r.message
    _exact([plain], refs, [2])


def test_malformed_result_is_a_failed_step(random_pair, refs):
    engine = _engine(random_pair, draft=False)
    execute, calls = engine.runner.execute, []

    def short_result(plan):  # the 2nd and 3rd executions lose request 0's argmax row
        res = execute(plan)
        calls.append(plan)
        return StepResult([[]] + res.argmax[1:], res.topk) if len(calls) in (2, 3) else res

    engine.runner.execute = short_result
    reqs = [_add(engine, 0), _add(engine, 1)]
    _drain(engine)
    for r in reqs:
        assert r.finish_reason is FinishReason.ERROR
        assert "StepError: request 0: 0 argmax rows, 1 expected" in r.message, r.message


def test_drafter_context_allocation_failure_at_admission(random_pair, refs):
    engine = _engine(random_pair)
    start, calls = engine.proposer.start_request, []

    def flaky(req_id, capacity):
        calls.append(req_id)
        if len(calls) == 2:
            raise MemoryError(f"no memory for a drafter context of {capacity} rows")
        start(req_id, capacity)

    engine.proposer.start_request = flaky
    reqs = [_add(engine, 0), _add(engine, 1)]
    assert engine.step() == [] and [r.request_id for r in engine.scheduler.waiting] == [0, 1]
    _drain(engine)
    _exact(reqs, refs, range(2))


def test_check_integrity_names_each_disagreement(random_pair):
    def corrupted(how):
        engine = _engine(random_pair, max_num_seqs=1)
        a, b = _add(engine, 0), _add(engine, 1)
        engine.step()
        how(engine, a, b)
        return engine

    cases = [
        (lambda e, a, b: setattr(b, "status", RequestStatus.RUNNING), "request 1 is running but queued as waiting"),
        (lambda e, a, b: e.scheduler.waiting.append(a), "a request is queued twice"),
        (lambda e, a, b: e.pool.admit(b.request_id, 20), "KV pool holds requests [1] that are not running"),
        (lambda e, a, b: e.pool.lifetime_blocks.update({7: 1}), "lifetime promises for requests [0, 7]"),
        (
            lambda e, a, b: e.proposer.stage_features(a.request_id, 15, 1),
            "proposer holds staged features for requests [0] between steps",
        ),
        (lambda e, a, b: e.proposer.start_request(b.request_id, 40), "proposer holds requests [0, 1]"),
    ]
    for how, message in cases:
        engine = corrupted(how)
        with pytest.raises(IntegrityError, match=message.replace("[", r"\[").replace("]", r"\]")):
            engine.check_integrity()
    adaptive = _engine(random_pair, speculation="adaptive")
    _add(adaptive, 0)
    adaptive.step()
    assert adaptive.scheduler.policy is not None
    adaptive.scheduler.policy.sample.retired.add(7)  # a retirement the scheduler never took, of no live request
    with pytest.raises(IntegrityError, match=r"retired from speculation: the policy holds \[7\]"):
        adaptive.check_integrity()


def test_score_raises_step_error_and_leaves_nothing_behind(random_pair):
    engine = _engine(random_pair, draft=False, max_num_seqs=1)
    FaultInjector(engine, "decode", at=0, times=2)
    with pytest.raises(StepError, match=r"scoring request 0 error: request 0: 2 steps it was part of failed"):
        engine.score([(PROMPTS[0], [1, 2, 3]), (PROMPTS[1], [4, 5])])
    assert not engine.has_work(), "the other scoring request must not be left queued"
    assert engine.finished[-1].finish_reason is FinishReason.ABORTED
    assert engine.pool.allocator.num_free == engine.pool.num_blocks
