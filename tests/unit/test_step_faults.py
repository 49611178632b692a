"""Engine.step is a transaction: a fault in a prefill, decode or verify forward, in the draft, in feature
staging, in the drafter-context allocation at admission, or a malformed result, rolls the whole plan back
(KV extends, speculative reservations, staged features, admissions); the step's requests are retried once
and finish with FinishReason.ERROR (the exception in the message) if their second step fails too. A fault
inside commit finishes the plan's unfinished requests with ERROR. In every case step() does not raise, every
other request produces exactly its bs=1 output, new requests are served, integrity holds after every step
(conftest) and the pool drains to fully free. The same in steps of random spans (verifies with span-1 rows,
decode steps of drafting requests). A span policy whose choice raises or breaks its bounds decodes that step
plainly and the engine goes on.
Also: check_integrity names the disagreements it must catch.

Run: python -m pytest -q tests/unit/test_step_faults.py
"""

from __future__ import annotations

import pytest

from refengine import FinishReason, RequestStatus, SamplingParams
from refengine.errors import IntegrityError, StepError
from refengine.plan import StepResult
from tests.adapter import assert_same_tokens, cpu_engine, greedy
from tests.faults import FaultInjector
from tests.span_policies import ScriptedSpans, random_spans

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


@pytest.mark.parametrize("point,at,after", [("decode", 0, False), ("decode", 2, True), ("verify", 1, True)])
def test_faults_in_steps_of_random_spans_are_lossless(random_pair, refs, point, at, after):
    """Random spans (tests/span_policies.py): a fault in a decode step of drafting requests (their features
    recorded) or in a verify mixing span-1 rows with drafted ones rolls back and is retried like any other."""
    engine = _engine(random_pair, span_policy=random_spans(16, seed=4, plain_share=0.4))
    inj = FaultInjector(engine, point, at=at, after=after)
    reqs = [_add(engine, i) for i in range(4)]
    _drain(engine)
    assert inj.fired == 1
    _exact(reqs, refs, range(4))


class _Unruly(ScriptedSpans):
    """Full blocks, but step 1 raises, step 3 asks for a span past the block and step 5 for too few spans."""

    def choose(self, req_ids, remaining):
        self.step += 1
        if self.step == 1:
            raise RuntimeError("a bug in the policy")
        if self.step == 3:
            return [99] * len(req_ids)
        if self.step == 5:
            return [1] * (len(req_ids) - 1)
        return [min(16, r) for r in remaining]


def test_a_failing_policy_choice_decodes_plainly_and_the_engine_goes_on(random_pair, refs):
    """The span policy's choice runs in the schedule, outside the step's transaction: a choice that raises, or
    gives spans outside 1..min(B, remaining) or of the wrong count, is logged and counted (span_stats' errors)
    and that step decodes plainly; the outputs stay exact and nothing leaks."""
    policy = _Unruly(16, lambda *a: [])
    engine = _engine(random_pair, span_policy=policy)
    reqs = [_add(engine, i) for i in range(4)]
    _drain(engine)
    assert engine.span_stats()["errors"] == 3, engine.span_stats()
    _exact(reqs, refs, range(4))


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


def test_score_raises_step_error_and_leaves_nothing_behind(random_pair):
    engine = _engine(random_pair, draft=False, max_num_seqs=1)
    FaultInjector(engine, "decode", at=0, times=2)
    with pytest.raises(StepError, match=r"scoring request 0 error: request 0: 2 steps it was part of failed"):
        engine.score([(PROMPTS[0], [1, 2, 3]), (PROMPTS[1], [4, 5])])
    assert not engine.has_work(), "the other scoring request must not be left queued"
    assert engine.finished[-1].finish_reason is FinishReason.ABORTED
    assert engine.pool.allocator.num_free == engine.pool.num_blocks
