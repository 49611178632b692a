"""Catch-up flushes in the adaptive policy's costs: the runner's `catch_up_s` (the lane's projection of more
pending context rows than the draft graph takes, after a prompt or a plain stretch: catch-up graph replays)
reaches the policy apart from the draft time; the draft curve leaves it out, a catch-up cost C(rows) = fixed +
per row is learnt from it (priced per row alone, the H200's mostly fixed catch-up cost looked 27-42 us a row),
and an exploration that would cause one is charged it, with the rows the lane says each request carries (a
prompt's, or a request's passed over by the probe sample, included). The lane side (graph path, CUDA) is
tests/gpu/test_gpu_catch_up.py; the catch-up graphs themselves, tests/unit/test_catch_up_graphs.py. In
simulation, with catch-ups costing 8 us a row, adaptive reaches 1.046 of the better of plain and fixed spans
at acceptance 0.6, c8 and 0.984 at 0.85, c32 (tenth session), against 0.805 and 0.763 with the catch-ups
inside the draft curve (drafting looked dear).

Run: python -m pytest tests/unit/test_catch_up_cost.py -q
"""

from __future__ import annotations

import pytest

from refengine import SamplingParams
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.step_costs import CostModel
from tests.adapter import cpu_engine, record_draft_costs
from tests.unit.test_adaptive import _simulate_phases

B = 16


def test_scheduler_hands_catch_up_apart(trained_pair):
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

    seen = record_draft_costs(engine)
    runner.execute = execute_with_catch_up  # type: ignore[method-assign]
    engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert charged and len(seen) == len(charged), (len(seen), len(charged))
    for (draft_s, catch_up_s), (draft, catch_up) in zip(seen, charged):
        assert abs(draft_s - draft) < 1e-12 and abs(catch_up_s - catch_up) < 1e-12, (draft_s, catch_up_s)


def test_policy_learns_catch_up_cost_and_charges_explorations():
    pol = AdaptivePolicy(B, cost=CostModel.linear(5e-3, 1e-5, 8e-6, 1.2e-3, 7e-5, p0=4.6e-3, p1=1.2e-5))
    pol.cost.plain.updates = pol.cost.verify.updates = 1  # both curves measured: no calibration step
    pol._next_explore = 10**9  # no exploration step in the stretches below
    pol.reprobe_every = 0  # nor a re-probe (tests/unit/test_adaptive_reprobe.py): the stretches stay plain
    ids = list(range(4))
    assert pol.choose(ids, [900] * 4) == [B] * 4  # new requests: first-step probes (prompt rows unknown)
    for r in ids:
        pol.observe_acceptance(r, B, 0)
    pol.observe_step(4, 4 * B, 4, 3e-3, 6e-3, 2e-3)  # a prompt catch-up: not learnt (rows unknown)
    assert pol.catch_ups == 0 and pol.cost.catch_up_s(100) == 0.0, "a catch-up priced before one was seen"
    assert pol.choose(ids, [900] * 4) == [B] * 4  # thin population evidence: a zero-accept probe is repeated once
    for r in ids:
        pol.observe_acceptance(r, B, 0)
    pol.observe_step(4, 4 * B, 4, 3e-3, 6e-3)
    draft_fit = list(pol.cost.draft.theta)
    carried = dict.fromkeys(ids, 1)  # rows since each request's last draft, as the lane counts them: its
    pol.pending = carried.__getitem__  # verify committed one (nothing accepted), then one a plain step

    def truth(rows: int) -> float:  # mostly fixed (launches, syncs), a little per row
        return 0.5e-3 + 1e-6 * rows

    for stretch in (20, 60, 120):  # plain stretches longer than a block, each ended by a catch-up
        for _ in range(stretch):
            assert pol.choose(ids, [900] * 4) == [1] * 4
            pol.observe_step(4, 4, 0, 0.0, 4.6e-3)
            for r in ids:
                carried[r] += 1
        spans = [B] * 4
        rows = pol._pending_rows(ids, spans)
        assert rows == 4 * (stretch + 1), rows  # each carries its last verify's row and the plain steps since
        pol._catch_up_rows = rows
        carried.update(dict.fromkeys(ids, 1))  # drafted: the projection caught up, the verify committed one row
        pol.observe_step(4, 4 * B, 4, 1.5e-3 + truth(rows), 6e-3, truth(rows))
    assert pol.catch_ups == 3 and pol.cost.draft.theta != draft_fit  # the draft curve: without the catch-ups
    for rows in (40, 400, 4000):  # a long stretch is priced near its cost, not 10x it (per row alone: 13 us)
        got, want = pol.cost.catch_up_s(rows), truth(rows)
        assert abs(got - want) < 0.25 * want, f"C({rows}) = {got * 1e3:.3f} ms, truth {want * 1e3:.3f} ms"
    d = pol.last
    assert d is not None
    tables = pol.estimates.tables(ids)
    for _ in range(20):
        pol.choose(ids, [900] * 4)
        pol.observe_step(4, 4, 0, 0.0, 4.6e-3)
        for r in ids:
            carried[r] += 1
    charged = pol._regret(spans, tables, d, ids) - pol._regret(spans, tables, d)
    assert charged == pytest.approx(pol.cost.catch_up_s(4 * 21)) and charged > 0.4e-3, charged


@pytest.mark.parametrize("concurrency,p_accept", [(8, 0.6), (32, 0.85)])
@pytest.mark.parametrize("fixed_s,row_s", [(0.0, 8e-6), (0.5e-3, 1e-6)], ids=["8us-a-row", "0.5ms+1us-a-row"])
def test_catch_up_costs_in_simulation(concurrency, p_accept, fixed_s, row_s):
    # catch-ups at 8 us a row, or mostly fixed (0.5 ms plus 1 us a row): adaptive within 3% of the better of
    # plain and fixed spans (catch-ups inside the draft curve, as before: 0.805 and 0.763 of it at 8 us a row)
    phases = [(concurrency, p_accept, 4, 128)]
    kw = dict(catch_up_fixed_s=fixed_s, catch_up_row_s=row_s)
    adaptive, plain, fixed = (_simulate_phases(m, phases, **kw)[0] for m in ("adaptive", "plain", "fixed"))
    assert adaptive >= 0.97 * max(plain, fixed), f"adaptive {adaptive:.0f}, plain {plain:.0f}, fixed {fixed:.0f}"


def test_carried_rows_come_from_the_lane_prompt_included(trained_pair):
    # unbound, nothing is known to carry and nothing is priced; in an engine the policy reads the lane's pending
    # rows: a request passed over by the probe sample explores with its whole context (prompt + every decoded
    # row) to catch up, ~7 ms at c32 on Qwen3-4B shapes
    pol = AdaptivePolicy(B)
    carried = {0: 200, 1: 3}
    assert pol._pending_rows([0, 1], [B, B]) == 0, "unbound: no rows known to carry"
    pol.pending = carried.__getitem__
    assert pol._pending_rows([0, 1], [B, B]) == 203
    assert pol._pending_rows([0, 1], [1, B]) == 0, "only request 1 drafts and carries under a block: no catch-up"
    engine = cpu_engine(trained_pair.target, trained_pair.draft, speculation="adaptive")
    policy = engine.scheduler.policy
    assert policy is not None and policy.pending is not None, "the scheduler binds the lane's pending rows"
    prompt = list(range(5, 45))
    req = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill: the prompt's rows are committed context, not projected yet
    rid = req.request_id
    assert policy.pending(rid) == engine.proposer.pending_rows(rid) == len(prompt), policy.pending(rid)
    assert policy._pending_rows([rid], [B]) == len(prompt), "a first draft catches the prompt up"


def test_a_speculating_choice_after_a_plain_stretch_pays_its_catch_up():
    # the choice charges every speculating candidate the catch-up of the rows its unretired requests carry past
    # a plain stretch (or a prompt): a step that barely beats plain on draft + verify alone stays plain while
    # that catch-up is due, and speculates once nothing carries more than a block (H200 run 97: the trained
    # tiny pair at c8 switched to speculation in 120 of 453 decisions, each verify step 2.8 ms where the choice
    # priced ~1.3 ms of draft and verify: 0.80 of plain)
    from refengine.spec_decode.span_choice import SPEC_MARGIN, choose_spans

    cost = CostModel.linear(5e-3, 1e-5, 8e-6, 1.2e-3, 7e-5, p0=4.6e-3, p1=1.2e-5)
    n = 4
    table = [0.0, 1.0] + [1.0 + 0.9 * (1 - 0.45 ** (s - 1)) / 0.55 * 0.45 for s in range(2, B + 1)]
    tables, remaining = [table] * n, [500] * n
    free = choose_spans(tables, remaining, B, cost)
    assert free.cap > 1 and set(free.spans) == {free.cap}, f"without a catch-up every request speculates: {free}"
    tokens = sum(table[s] for s in free.spans)
    spec_s = cost.draft_s(n) + cost.verify_s(n, sum(free.spans))
    even = tokens / (free.plain_tok_per_s * SPEC_MARGIN) - spec_s  # the catch-up at which plain wins the choice
    assert even > 0, (tokens, spec_s, free)
    assert choose_spans(tables, remaining, B, cost, switch_s=0.9 * even).cap > 1, "a smaller catch-up still pays"
    assert choose_spans(tables, remaining, B, cost, switch_s=1.1 * even).cap == 1, "a larger one keeps it plain"

    pol = AdaptivePolicy(B, cost=cost)
    carried = dict.fromkeys(range(n), 200)
    pol.pending = carried.__getitem__
    pol.cost.catch_up.update([1.0, 200.0], 0.5 + 0.2)  # C(200) learnt: ~0.7 ms
    assert pol.cost.catch_up_s(n * 200) > 0
    assert pol._switch_s(list(range(n))) == pytest.approx(pol.cost.catch_up_s(n * 200))
    carried.update(dict.fromkeys(range(n), 1))
    assert pol._switch_s(list(range(n))) == 0.0, "nothing carries more than a block: no catch-up"
    carried[0] = 200
    pol.sample.retired.add(0)
    assert pol._switch_s(list(range(n))) == 0.0, "a retired request never drafts: its rows are no catch-up"
