"""Engine.abort: a waiting request, a running plain request and a running speculating request are each
finished at once with FinishReason.ABORTED, their KV blocks and drafter context freed before the next step;
aborting twice, or an unknown id, returns False; every other request still produces exactly its bs=1 output;
the integrity cross-check holds after every step and the pool drains to fully free.

Run: python -m pytest -q tests/unit/test_abort.py
"""

from __future__ import annotations

from refengine import FinishReason, RequestStatus, SamplingParams
from tests.adapter import assert_same_tokens, cpu_engine, greedy

PROMPTS = [[5, 9, 13, 2, 7] * 3, [101, 7, 8] * 6, [3] * 16, [44, 45, 46, 47] * 8, [9, 8, 7, 6, 5, 4, 3]]
BUDGETS = [30, 20, 40, 25, 17]
LOGPROBS = [0, 2, 0, 0, 0]  # request 1 is ineligible (plain decode), the others speculate


def _free(engine) -> int:
    return engine.pool.allocator.num_free


def test_abort_waiting_running_plain_and_speculating(random_pair):
    ref = [greedy(cpu_engine(random_pair.target, max_num_seqs=1), [p], m)[0] for p, m in zip(PROMPTS, BUDGETS)]
    engine = cpu_engine(random_pair.target, random_pair.draft, max_num_seqs=3, num_blocks=24)
    reqs = [
        engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True, logprobs=lp))
        for p, m, lp in zip(PROMPTS[:4], BUDGETS[:4], LOGPROBS[:4])
    ]
    engine.step()  # prefill of 0, 1, 2; request 3 waits (max_num_seqs=3)
    engine.check_integrity()
    waiting = reqs[3]
    assert waiting.status is RequestStatus.WAITING and engine.get_request(waiting.request_id) is waiting
    assert engine.abort(waiting.request_id, "client went away")
    assert waiting.finish_reason is FinishReason.ABORTED and waiting.message == "client went away"
    assert waiting.output_ids == [] and engine.get_request(waiting.request_id) is None
    engine.check_integrity()

    for _ in range(3):
        engine.step()
        engine.check_integrity()
    spec = reqs[2]
    assert spec.status is RequestStatus.RUNNING and spec.spec.verify_steps > 0, "request 2 should be speculating"
    held = len(engine.pool.table(spec.request_id))
    before = _free(engine)
    assert engine.abort(spec.request_id)
    assert spec.finish_reason is FinishReason.ABORTED and spec.message == "aborted by the caller"
    assert _free(engine) == before + held, f"abort freed {_free(engine) - before} blocks, request held {held}"
    assert spec.request_id not in engine.proposer.live_requests(), "drafter context still held after abort"
    engine.check_integrity()

    engine.step()
    engine.check_integrity()
    plain = reqs[1]
    assert plain.status is RequestStatus.RUNNING and len(plain.output_ids) > 1
    n_out = len(plain.output_ids)
    assert engine.abort(plain.request_id)
    assert not engine.abort(plain.request_id), "aborting a finished request must return False"
    assert not engine.abort(spec.request_id) and not engine.abort(waiting.request_id)
    assert not engine.abort(12345), "an unknown id must return False"
    assert plain.finish_reason is FinishReason.ABORTED and len(plain.output_ids) == n_out
    engine.check_integrity()

    late = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=BUDGETS[4], ignore_eos=True))
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    assert not engine.abort(reqs[0].request_id), "a request that finished normally cannot be aborted"
    assert_same_tokens(reqs[0].output_ids, ref[0], "request 0 next to aborted ones")
    assert_same_tokens(late.output_ids, ref[4], "request admitted after the aborts")
    assert {r.request_id for r in engine.finished} >= {r.request_id for r in reqs} | {late.request_id}
    assert _free(engine) == engine.pool.num_blocks, f"{engine.pool.num_blocks - _free(engine)} blocks leaked"
    assert engine.proposer.live_requests() == set()


def test_abort_before_any_step_frees_nothing_and_others_run(random_pair):
    engine = cpu_engine(random_pair.target, random_pair.draft, num_blocks=8)
    a = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True))
    b = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=5, ignore_eos=True))
    assert engine.abort(a.request_id)
    engine.check_integrity()
    while engine.has_work():
        engine.step()
    assert a.output_ids == [] and a.finish_reason is FinishReason.ABORTED
    assert b.finish_reason is FinishReason.LENGTH and len(b.output_ids) == 5
    assert _free(engine) == engine.pool.num_blocks
