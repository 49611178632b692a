"""Adaptive mode's plain stretches (refengine/spec_decode/plain_stretch.py): while the policy's plain decision
holds for an unchanged batch, the scheduler plans the same plain step again without asking the policy, and
counts the steps instead of recording each in every request's SpecStats. Checks that:
- AdaptivePolicy.reuse_plain answers True exactly when choose would reuse its plain decision at O(1), also as
  the budgets shrink under a block; a plain choice at budgets of a block or more is plain again when the budgets
  shrink evenly (random tables and costs: always at equal budgets; at unequal ones in all but a few cases, none
  predicted more than 1% past SPEC_MARGIN);
- every request's stats equal, in order, the tokens each of its steps committed (logged around the commit),
  with drafting steps between stretches, requests joining and leaving mid-stretch, and an abort mid-stretch;
- the stretch is used (most plain steps skip the choice);
- a stretch's steps give the policy one cost sample in STRETCH_SAMPLE (their mean, counted as that many
  steps), the last ones when it closes; with graphs captured on first use, only the samples whose steps
  captured one are dropped, not the rest of the stretch after them (its plans do not count captures).

Run: python -m pytest tests/unit/test_plain_stretch.py -q
"""

from __future__ import annotations

import random
from collections import Counter

from refengine import SamplingParams
from refengine.plan import PrefillPlan
from refengine.spec_decode.acceptance_estimate import table_from_rates
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.plain_stretch import STRETCH_SAMPLE
from refengine.spec_decode.span_choice import SPEC_MARGIN, choose_spans
from refengine.spec_decode.step_costs import CostModel
from tests.adapter import cpu_engine

B = 16


def test_reuse_plain_answers_as_choose_would():
    pol = AdaptivePolicy(B, cost=CostModel.linear(10e-3, 2e-5, 1e-5, 3e-3, 1e-4))
    pol.cost.plain.updates = pol.cost.verify.updates = 1  # both curves measured: no calibration step
    for rid in range(40):
        pol.observe_acceptance(rid, B, 0)  # the workload's first blocks accept nothing: plain wins
    ids = [0, 1, 2]  # probed already (above), so not new
    pol._next_explore = 100
    assert pol.choose(ids, [80, 90, 70]) == [1, 1, 1]
    steps = pol.steps
    assert pol.reuse_plain(69) and pol.steps == steps + 1, "the plain decision holds one step on"
    pol._next_explore = pol.steps + 1
    assert not pol.reuse_plain(60), "an exploration is due: choose must run"
    pol._next_explore = 100
    assert pol.choose(ids, [60, 60, 60]) == [1, 1, 1] and pol.reuse_plain(59)
    searched = pol.searched
    assert pol.reuse_plain(B - 1) and pol.reuse_plain(3), "budgets shrinking under a block: the decision holds"
    assert pol.choose(ids, [2, 9, 4]) == [1, 1, 1] and pol.searched == searched, "and choose reuses it too"
    assert not pol.reuse_plain(4), "a budget that grew (another batch's) changes the key"
    assert pol.choose(ids, [1, 8, 3]) == [1, 1, 1] and pol.reuse_plain(1)
    pol.observe_acceptance(1, B, 3)
    assert not pol.reuse_plain(1), "something was learnt: the cached decision is stale"


def test_a_plain_choice_stays_plain_as_budgets_shrink_evenly():
    """What AdaptivePolicy._holds rests on: wherever the search chooses plain with every budget at least a block,
    it chooses plain as the budgets shrink one token a step (a plain stretch), over random per-position rates,
    costs and graph-like row shapes: at equal budgets always (each candidate then was a candidate before); at
    unequal ones (a stretch after probes that committed more than one token) in all but a few cases, none of
    them predicted more than 1% past SPEC_MARGIN."""
    rng = random.Random(11)
    plain_cases, checks, equal_flips, excess = 0, 0, [], []
    for case in range(3000):
        n = rng.choice([1, 2, 3, 5, 8, 16, 32])
        cost = CostModel.linear(
            rng.uniform(1e-3, 8e-3), rng.uniform(0, 1e-4), rng.uniform(0, 2e-5), rng.uniform(2e-4, 3e-3),
            rng.uniform(0, 1e-4), p0=rng.uniform(1e-3, 8e-3), p1=rng.uniform(0, 1e-4),
        )  # fmt: skip
        cap = rng.choice([B, 4, 8])

        def rows(m: int, r: int, cap: int = cap) -> int:
            return m * min(cap, max(1, -(-r // m)))  # a graph's shape: requests x a row cap

        tables = []
        for _ in range(n):
            hi = rng.uniform(0, 1)
            tables.append(table_from_rates([rng.uniform(0, hi) for _ in range(B - 1)]))
        low = rng.randint(B, B + 8)
        spread = rng.choice([0, 1, 3, 8, 20])
        budgets = [low + rng.randint(0, spread) for _ in range(n)]
        if choose_spans(tables, budgets, B, cost, rows).cap != 1:
            continue
        plain_cases += 1
        for t in range(low - B + 1, max(budgets)):
            shrunk = [max(1, r - t) for r in budgets]
            d = choose_spans(tables, shrunk, B, cost, rows)
            checks += 1
            if d.cap == 1:
                continue
            if len(set(shrunk)) == 1:
                equal_flips.append((case, n, shrunk[0], d.spans))
            excess.append(d.predicted_tok_per_s / (d.plain_tok_per_s * SPEC_MARGIN))
    assert plain_cases > 1000 and checks > 20000, f"{plain_cases} plain cases, {checks} checks: the test lost its point"
    assert not equal_flips, (
        f"equal budgets chose to speculate after plain; first (case, n, budget, spans): {equal_flips[:3]}"
    )
    assert len(excess) <= checks // 1000 and max(excess, default=1.0) < 1.01, (
        f"{len(excess)} of {checks} shrunk budgets chose to speculate after plain, up to "
        f"{max(excess):.4f}x plain's rate with its margin"
    )


def _engine(trained_pair, drafting_steps: set[int], max_num_seqs: int = 4, **kw):
    """An adaptive CPU engine whose decisions are forced: full spans at the decisions numbered in
    `drafting_steps`, plain otherwise (reuse_plain declines exactly before a drafting decision)."""
    engine = cpu_engine(
        trained_pair.target, trained_pair.draft, max_num_seqs=max_num_seqs, speculation="adaptive", **kw
    )
    policy = engine.scheduler.policy
    assert policy is not None
    decisions, reused = [0], [0]

    def forced_choose(req_ids, remaining):
        policy.steps += 1  # (what the real choice counts)
        decisions[0] += 1
        return [B if decisions[0] - 1 in drafting_steps else 1] * len(req_ids)

    def forced_reuse(min_remaining):
        if decisions[0] in drafting_steps or min_remaining < B:
            return False
        decisions[0] += 1
        reused[0] += 1
        return True

    policy._choose = forced_choose  # type: ignore[method-assign]
    policy.reuse_plain = forced_reuse  # type: ignore[method-assign]
    return engine, reused


def _log_commits(engine) -> dict[int, list[int]]:
    """Per request, the tokens each of its decode / verify steps committed, read around Scheduler.commit."""
    sched, log = engine.scheduler, {}
    commit = sched.commit

    def logged(plan, result):
        before = {r.request_id: len(r.output_ids) for r in plan.requests}
        commit(plan, result)
        if not isinstance(plan, PrefillPlan):
            for r in plan.requests:
                log.setdefault(r.request_id, []).append(len(r.output_ids) - before[r.request_id])

    sched.commit = logged  # type: ignore[method-assign]
    return log


def _check_stats(req, steps: list[int]) -> None:
    s = req.spec
    got = s.committed_per_step
    first = next((i for i, (a, b) in enumerate(zip(got, steps)) if a != b), min(len(got), len(steps)))
    assert got == steps, (
        f"request {req.request_id}: {len(got)} steps in its stats, {len(steps)} committed; first divergent "
        f"position {first}: stats {got[first : first + 8]}, steps {steps[first : first + 8]}"
    )
    assert s.verify_steps == len(steps) and s.committed_tokens == sum(steps) == len(req.output_ids) - 1
    assert s.accepted_hist == Counter(steps) and sum(s.span_hist.values()) == len(steps)


def test_stats_equal_each_steps_commits_in_order(trained_pair):
    engine, reused = _engine(trained_pair, drafting_steps={0, 1, 30, 31, 55, 56, 80})
    log = _log_commits(engine)
    prompts = [list(range(5, 30)), list(range(40, 52)), [7, 9, 11, 13] * 5, list(range(60, 75))]
    budgets = [70, 45, 90, 60]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in budgets]
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    for _ in range(20):
        engine.step()
    reqs += [engine.add_request(p, sp) for p, sp in zip(prompts[2:], params[2:])]  # join mid-stretch
    while engine.has_work():
        engine.step()
    assert reused[0] > 30, f"only {reused[0]} steps reused the plain decision: no stretch was exercised"
    ordered = [r for r in reqs if any(a > 1 for a in log[r.request_id][1:])]
    assert ordered, f"no drafting step after the first committed more than one token: {log}"
    for r in reqs:
        _check_stats(r, log[r.request_id])


def test_an_abort_mid_stretch_leaves_complete_stats(trained_pair):
    engine, reused = _engine(trained_pair, drafting_steps={0})
    log = _log_commits(engine)
    a, b = (engine.add_request(p, SamplingParams(max_tokens=80, ignore_eos=True)) for p in ([5, 7, 9], [11, 12]))
    for _ in range(25):
        engine.step()
    assert reused[0] > 10 and engine.scheduler._stretch is not None and engine.scheduler._stretch.steps > 0
    assert engine.abort(a.request_id)
    _check_stats(a, log[a.request_id])
    assert engine.spec_stats([b]).verify_steps == len(log[b.request_id]), "a running request's stats on demand"
    while engine.has_work():
        engine.step()
    _check_stats(b, log[b.request_id])


def test_stretch_steps_are_sampled_in_windows_and_again_after_a_capture(trained_pair):
    # cold graphs: the stretch's first step captures the decode graph (its window is no cost sample), and the
    # windows after it, planned without the scheduler's per-plan capture count, must be samples again
    engine, reused = _engine(trained_pair, drafting_steps={0}, max_num_seqs=2, graph_mode="piecewise")
    policy = engine.scheduler.policy
    before = engine.runner.graph_captures()
    observe, windows = policy.observe_step, []

    def recording(n, rows, drafted, *args, **kw):
        if not drafted:
            # args: draft_s, verify_s, catch_up_s, carried_rows, steps
            windows.append(kw.get("steps", args[4] if len(args) > 4 else 1))
        return observe(n, rows, drafted, *args, **kw)

    policy.observe_step = recording
    engine.generate([[5, 7, 9]], SamplingParams(max_tokens=60, ignore_eos=True))
    decodes = engine.scheduler.plan_counts["decode"]
    captured = engine.runner.graph_captures() - before
    assert reused[0] > 20 and captured > 0, (reused[0], captured)
    # 20+ reused steps: whole windows; the last steps (budgets under a block) are one-step stretches
    assert windows.count(STRETCH_SAMPLE) >= 2, f"sampled windows of steps {windows}"
    assert decodes - sum(windows) <= captured * STRETCH_SAMPLE, (
        f"{decodes} plain steps, {sum(windows)} sampled in windows {windows}, {captured} captures"
    )
