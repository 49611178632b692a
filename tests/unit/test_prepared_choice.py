"""The prepared choice (AdaptivePolicy.prepare, Scheduler.while_waiting): while a speculating step runs, the policy
computes the next choice's acceptance tables and span search for the requests that will still be running; the next
choice takes it when it is for the same requests, no choice came between and it speculates by at least the policy's
`prepared_margin`, and otherwise searches as before. Checked here: with nothing observed in between it equals a
fresh choice; observations in between do not change it (it is one step stale by design); other requests, an
intervening choice, a plain or a marginal prepared decision are not taken; the engine prepares during its verify
steps and stays lossless, also when the preparation raises (counted as a policy error, logged); in simulation it
loses nothing beyond noise against the fresh choice, also under steady arrivals where speculation is marginal
(where, without the margin, stale searches held off retirement).

Run: python -m pytest tests/unit/test_prepared_choice.py -q
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from refengine import SamplingParams
from refengine.spec_decode.acceptance_profile import parse_profile
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.prepared_choice import PREPARED_MARGIN
from refengine.spec_decode.step_costs import CostModel
from tests.adapter import assert_same_tokens, cpu_engine, greedy
from tests.unit.test_adaptive import _simulate, _simulate_phases
from tests.unit.test_adaptive_steady import H200_LOOKS

B = 16


def _speculating_policy(ids: list[int], accepted: int) -> AdaptivePolicy:
    """A policy past calibration and first-step probes whose requests each accepted `accepted` drafts of
    a full block twice (a memory-bound verify: speculation pays when they accept), and its choice for them: the
    step whose run a preparation overlaps."""
    pol = AdaptivePolicy(B, cost=CostModel.linear(5e-3, 1e-5, 8e-6, 1.2e-3, 7e-5, p0=4.6e-3, p1=1.2e-5))
    pol.cost.plain.updates = pol.cost.verify.updates = 1  # both curves measured: no calibration step
    pol._next_explore = 10**9  # no exploration step
    for _ in range(2):
        for r in ids:
            pol.observe_acceptance(r, B, accepted)
    pol.drafted = {r: (3, 0) for r in ids}  # probed enough: no follow-up probes
    pol.choose(ids, [101] * len(ids))
    return pol


def test_no_search_is_prepared_after_a_plain_decision():
    # a step that drafts only probes or an exploration runs on a plain decision: a search on what it knew is
    # plain too and would not be taken (H200, the trained tiny pair at c8: its probe step ran two searches)
    ids, rem = [0, 1, 2, 3], [100] * 4
    plain, spec = _speculating_policy(ids, accepted=0), _speculating_policy(ids, accepted=12)
    assert plain.last is not None and plain.last.cap == 1 and spec.last is not None and spec.last.cap > 1
    plain.prepare(ids, rem)
    spec.prepare(ids, rem)
    assert plain._prepared is None, "a search was prepared after a plain decision"
    assert spec._prepared is not None and spec._prepared.decision.cap > 1, "no search prepared after speculating"


def test_a_prepared_choice_equals_a_fresh_one_when_nothing_is_observed_between():
    ids, rem = [0, 1, 2, 3], [100] * 4
    pol = _speculating_policy(ids, accepted=12)
    fresh = copy.deepcopy(pol)
    pol.prepare(ids, rem)
    got, want = pol.choose(ids, rem), fresh.choose(ids, rem)
    assert max(want) > 1, want
    assert got == want and pol.prepared == 1 and fresh.prepared == 0, (got, want, pol.prepared)


def test_a_prepared_choice_is_one_step_stale():
    # requests accepting everything, then rejecting their first drafts (20 blocks each) after the preparation:
    # the fresh choice sees the rejections and decodes plainly, the prepared one does not (the next would)
    ids, rem = [0, 1, 2, 3], [100] * 4
    pol = _speculating_policy(ids, accepted=15)
    pol.prepare(ids, rem)
    fresh = copy.deepcopy(pol)
    fresh._prepared = None
    for p in (pol, fresh):
        for _ in range(20):
            for r in ids:
                p.observe_acceptance(r, B, 0)
    got, want = pol.choose(ids, rem), fresh.choose(ids, rem)
    assert pol.prepared == 1 and got == [B] * 4, (got, pol.prepared)
    assert want != got, f"the fresh choice {want} should differ from the stale one {got} after 80 rejections"


@pytest.mark.parametrize("case", ["other requests", "a choice between", "plain"])
def test_a_prepared_choice_is_taken_only_for_the_next_choice_of_the_same_requests(case):
    ids, rem = [0, 1, 2, 3], [100] * 4
    pol = _speculating_policy(ids, accepted=0 if case == "plain" else 12)
    pol.prepare(ids, rem)
    if case == "a choice between":
        pol.choose(ids, rem)  # takes it
        pol.prepared = 0
    ask = ids[:3] if case == "other requests" else ids
    fresh = copy.deepcopy(pol)
    fresh._prepared = None
    got, want = pol.choose(ask, rem[: len(ask)]), fresh.choose(ask, rem[: len(ask)])
    assert pol.prepared == 0 and got == want, (case, got, want, pol.prepared)
    assert (max(got) == 1) == (case == "plain"), (case, got)


def test_the_engine_prepares_during_verify_steps_and_stays_lossless(trained_pair):
    # the CPU engine prepares after each verify step's forward, before its commit (Engine.step), as the graph
    # path does while the verify graph runs: the choices that take it change only spans, never tokens
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(4)]
    plain = greedy(cpu_engine(trained_pair.target), prompts, 48)
    engine = cpu_engine(trained_pair.target, trained_pair.draft, speculation="adaptive")
    policy = engine.scheduler.policy
    assert policy is not None
    got = engine.generate(prompts, [SamplingParams(max_tokens=48, ignore_eos=True)] * 4)
    for i, (r, want) in enumerate(zip(got, plain)):
        assert_same_tokens(r.output_ids, want, f"request {i}")
    verify_steps = engine.scheduler.plan_counts["verify"]
    assert policy.prepared > 0 and policy.errors == 0, (policy.prepared, verify_steps, policy.errors)
    assert policy.summary()["prepared"] == policy.prepared


def test_a_failing_preparation_is_counted_and_the_engine_goes_on(trained_pair, caplog):
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(4)]
    plain = greedy(cpu_engine(trained_pair.target), prompts, 32)
    engine = cpu_engine(trained_pair.target, trained_pair.draft, speculation="adaptive")
    policy = engine.scheduler.policy
    assert policy is not None

    def broken(req_ids, remaining):
        raise ValueError("a bug in the preparation")

    policy.prepare = broken  # type: ignore[method-assign]
    got = engine.generate(prompts, [SamplingParams(max_tokens=32, ignore_eos=True)] * 4)
    for i, (r, want) in enumerate(zip(got, plain)):
        assert_same_tokens(r.output_ids, want, f"request {i}")
    verify_steps = engine.scheduler.plan_counts["verify"]
    assert verify_steps and policy.errors == verify_steps and policy.prepared == 0, (verify_steps, policy.errors)
    assert "preparation failed (ValueError: a bug in the preparation)" in caplog.text


def test_a_marginal_prepared_choice_is_not_taken():
    ids, rem = [0, 1, 2, 3], [100] * 4
    pol = _speculating_policy(ids, accepted=12)
    pol.prepare(ids, rem)
    ready = pol._prepared
    assert ready is not None
    d = ready.decision
    assert d.predicted_tok_per_s >= PREPARED_MARGIN * d.plain_tok_per_s, d  # taken as it is
    marginal = replace(d, predicted_tok_per_s=0.99 * PREPARED_MARGIN * d.plain_tok_per_s)
    pol._prepared = ready._replace(decision=marginal)
    pol.choose(ids, rem)
    assert pol.prepared == 0


def test_prepared_choices_hold_off_no_retirement_where_speculation_is_marginal():
    # steady arrivals at c32 with the sharegpt profile, where the fresh choice speculates in a handful of
    # 1200-1400 decisions and requests retire: a stale search that speculates on a noisy high estimate (the
    # next blocks regress to the mean) counts as a decision to speculate, holds off the plain regime, and the
    # next preparation repeats it. Without PREPARED_MARGIN: 0.897 / 0.977 / 0.897 of plain on paths 1-3 against
    # the fresh choice's 0.946 / 0.931 / 0.950 (43 and 48 prepared choices taken; 73 and 133 retirements
    # against 423 and 448)
    prof = parse_profile("sharegpt")
    draw = lambda rng, span: prof.draw(rng, span)  # noqa: E731
    phase = [(32, draw, 20, 128)]
    for seed in (1, 2, 3):
        kw = dict(steady=True, seed=seed, **H200_LOOKS, prefill_taps_s=2.4e-3)
        (fresh,) = _simulate_phases("adaptive", phase, **kw)
        (prepared,) = _simulate_phases("adaptive", phase, prepared=True, **kw)
        assert prepared >= 0.99 * fresh, f"path {seed}: prepared {prepared:.0f} against fresh {fresh:.0f} tok/s"


@pytest.mark.parametrize(("p_accept", "concurrency"), [(0.25, 8), (0.6, 32), (0.85, 1), (0.85, 32)])
def test_prepared_choices_lose_nothing_in_simulation(p_accept, concurrency):
    # the same waves and draws, choices prepared a step early or made fresh (no host time in the simulation:
    # this is the stale estimates' cost alone, which the host time the preparation hides has to beat)
    fresh = _simulate("adaptive", p_accept, concurrency)
    prepared = _simulate("adaptive", p_accept, concurrency, prepared=True)
    assert prepared >= 0.98 * fresh, f"prepared {prepared:.0f} against fresh {fresh:.0f} tok/s"
