"""When the adaptive policy gets a step's cost sample: the scheduler takes it at the step's commit and hands it
over while the next step's graph runs (the runner's `while_waiting`, between the launch and the one host sync),
or after the next step's execute when that step has no graph (a prefill, eager), or at once when the engine
goes idle. Checks that every step is sampled exactly once (a plain stretch's steps in windows of
STRETCH_SAMPLE) and each sample arrives in the window of the step after its last when that step is graphed,
and with its own step's carried context rows (the catch-up it paid), not the rows of the choice made since.

Run: python -m pytest tests/unit/test_cost_sample_timing.py -q
"""

from __future__ import annotations

import itertools

from tests.adapter import cpu_engine, greedy

B = 16


def _adaptive(trained_pair):
    engine = cpu_engine(
        trained_pair.target, trained_pair.draft, graph_mode="full", max_num_seqs=4, speculation="adaptive"
    )
    assert engine.capture_graphs() > 0  # no step captures a graph: every decode / verify step is a sample
    policy = engine.scheduler.policy
    assert policy is not None
    return engine, policy


def _freeze_costs(policy) -> None:
    """Step costs that make plain win after the first-step probes, whatever this machine's timings (the
    choice follows measured costs: under a loaded CPU, as in CI's `-n 2`, it sometimes never settled into a
    plain stretch). Samples still reach observe_step; they no longer move the costs."""
    cost = policy.cost
    for kind, seconds in (("plain", 1e-3), ("verify", 3e-3), ("draft", 2e-3)):
        cost.tables[kind] = dict.fromkeys(cost.tables[kind], seconds)
    cost.verify.theta, cost.draft.theta, cost.plain.theta = [3.0, 0.0, 0.0], [2.0, 0.0], [1.0, 0.0]
    cost.observe = lambda *args, **kw: None
    cost.observe_catch_up = lambda *args, **kw: None


def test_each_sample_arrives_once_while_the_next_graph_runs(trained_pair):
    engine, policy = _adaptive(trained_pair)
    _freeze_costs(policy)
    runner, where = engine.runner, ["outside"]
    window = runner.while_waiting
    assert window is not None, "an adaptive engine hands its cost samples over in the graph wait"

    def in_window():
        where[0] = "window"
        window()
        where[0] = "outside"

    fed: list[tuple[str, int, int]] = []  # (where, steps planned so far, steps sampled) per sample handed over
    observe = policy.observe_step

    def logged(*args):
        counts = engine.scheduler.plan_counts
        fed.append((where[0], counts["verify"] + counts["decode"], args[7] if len(args) > 7 else 1))
        return observe(*args)

    runner.while_waiting = in_window
    policy.observe_step = logged  # type: ignore[method-assign]
    greedy(engine, [[5, 7, 9], [11, 12, 13, 14, 15]], [30, 23])
    steps = engine.scheduler.plan_counts["verify"] + engine.scheduler.plan_counts["decode"]
    sampled = [k for _, _, k in fed]
    assert sum(sampled) == steps, f"samples of {sampled} steps handed over for {steps} decode / verify steps"
    assert max(sampled) > 1, f"samples of {sampled} steps: a plain stretch is sampled in windows"
    # a sample taken at step t (its window's last) is fed during step t + 1; the last one when the engine went idle
    taken = list(itertools.accumulate(sampled))
    assert [n for _, n, _ in fed] == [t + 1 for t in taken[:-1]] + [steps], (fed, taken)
    outside = [i for i, (w, _, _) in enumerate(fed) if w != "window"]
    assert outside == [len(fed) - 1], f"samples fed outside a graph wait: {outside} of {len(fed)} (want the last)"


def test_a_sample_carries_its_own_steps_catch_up_rows(trained_pair):
    engine, policy = _adaptive(trained_pair)
    runner = engine.runner
    drafting_steps = {0, 21, 45}  # a first-step probe, then drafts after plain stretches longer than a block

    def forced(req_ids, remaining):
        policy.steps += 1  # (what the real choice counts)
        return [B if policy.steps - 1 in drafting_steps else 1] * len(req_ids)

    carried: list[int] = []  # carried rows of each drafting choice, as choose left them
    choose = policy.choose

    def choose_and_note(req_ids, remaining):
        spans = choose(req_ids, remaining)
        if max(spans) > 1:
            carried.append(policy.carried_rows)
        return spans

    execute = runner.execute

    def execute_with_catch_up(plan):
        before = runner.timings["draft_s"]
        result = execute(plan)
        runner.timings["catch_up_s"] += 0.4 * (runner.timings["draft_s"] - before)  # stands in for the lane's
        return result

    learnt: list[int] = []
    observe_catch_up = policy.cost.observe_catch_up

    def note_catch_up(rows, seconds):
        learnt.append(rows)
        observe_catch_up(rows, seconds)

    policy._choose = forced  # type: ignore[method-assign]
    policy.choose = choose_and_note  # type: ignore[method-assign]
    policy.cost.observe_catch_up = note_catch_up  # type: ignore[method-assign]
    runner.execute = execute_with_catch_up  # type: ignore[method-assign]
    greedy(engine, [list(range(5, 20))], 90)
    # the probe's 15 prompt rows fit the draft graph (at most B): no catch-up
    assert carried[0] == 0 and all(c > B for c in carried[1:]), carried
    assert learnt == carried[1:], f"catch-ups learnt with rows {learnt}, the drafting steps carried {carried}"
