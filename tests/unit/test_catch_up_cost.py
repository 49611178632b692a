"""The adaptive policy's draft cost leaves out catch-up flushes: the runner's `catch_up_s` (the lane's eager
projection of more pending context rows than the draft graph takes, after a prompt or a plain stretch) is
subtracted from the draft time the scheduler hands the policy, while the bench's draft column keeps it.
On the H200 the trained tiny pair's drafts looked 4x dearer with it left in (2.0 vs 0.5 ms) and adaptive
never drafted. The lane side (graph path, CUDA) is tests/gpu/test_gpu_catch_up.py.

Run: python -m pytest tests/unit/test_catch_up_cost.py -q
"""

from __future__ import annotations

from refengine import SamplingParams
from tests.adapter import cpu_engine

B = 16


def test_policy_draft_samples_leave_out_catch_up(trained_pair):
    engine = cpu_engine(trained_pair.target, trained_pair.draft, speculation="adaptive")
    policy, runner = engine.scheduler.policy, engine.runner
    assert policy is not None
    policy.choose = lambda ids, remaining: [B] * len(ids)  # every step drafts
    execute = runner.execute
    charged: list[tuple[float, float]] = []  # per verify step: (draft time, catch-up time) the runner recorded

    def execute_with_catch_up(plan):
        before = runner.timings["draft_s"]
        result = execute(plan)
        draft = runner.timings["draft_s"] - before
        catch_up = 0.4 * draft  # stands in for the lane's timed eager flush (graph path, CUDA only)
        runner.timings["catch_up_s"] += catch_up
        if draft:
            charged.append((draft, catch_up))
        return result

    seen: list[float] = []
    observe = policy.observe_step

    def observe_step(n, rows, drafted, draft_s, verify_s):
        if drafted:
            seen.append(draft_s)
        return observe(n, rows, drafted, draft_s, verify_s)

    runner.execute = execute_with_catch_up  # type: ignore[method-assign]
    policy.observe_step = observe_step  # type: ignore[method-assign]
    engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert charged and len(seen) == len(charged), (len(seen), len(charged))
    for got, (draft, catch_up) in zip(seen, charged):
        assert abs(got - (draft - catch_up)) < 1e-12, (
            f"policy saw {got * 1e3:.4f} ms, want {(draft - catch_up) * 1e3:.4f}"
        )
