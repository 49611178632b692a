"""The host's share of a step in the adaptive policy's costs (refengine/spec_decode/cost_samples.py, step_costs.py
H_verify / H_plain). Checks that:
- CostSamples counts a step's host time as its wall time less the runner's synchronised work, by kind of step,
  and hands the means over with the cost samples;
- an adaptive CPU engine with CostModel.price_host fits both kinds from its own steps (host_ms_model in the
  policy's stats), and without it its verify steps only, timed from their choice (a dormant wave's plain steps
  pay nothing for the measurement);
- the choice prices them only with price_host (off by default: no gain measured on the H200, docs/PERF.md), and
  then a speculating choice that wins on the runner's times alone, but not once its extra host time is paid, is
  plain;
- a large batch's plain-regime test prices H_verify whenever it is measured (CostModel.host_s(regime=True)): a
  c8 batch whose speculation wins on the runner's times alone, and loses once its host time is paid, is in a
  plain regime; a c1 one is not (H200 run 152: the trained tiny pair's c8 waves woke a dormant policy without it).

Run: python -m pytest tests/unit/test_host_costs.py -q
"""

from __future__ import annotations

import pytest

from refengine import SamplingParams
from refengine.plan import DecodePlan, VerifyPlan
from refengine.spec_decode import cost_samples
from refengine.spec_decode.acceptance_estimate import geometric_table, table_from_rates
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.cost_samples import BUSY, TIMINGS, CostSamples
from refengine.spec_decode.retirement import RETIRE_AFTER
from refengine.spec_decode.span_choice import choose_spans, plain_wins_uniformly, uniform_spec_costs
from refengine.spec_decode.step_costs import CostModel
from tests.adapter import cpu_engine

B = 16


def test_a_steps_host_time_is_its_wall_less_the_runners_work(monkeypatch):
    policy = AdaptivePolicy(B)
    samples = CostSamples(policy)
    timings = dict.fromkeys(TIMINGS + BUSY, 0.0)
    samples.bind(timings, None)
    clock = iter([10.0, 10.0100, 20.0, 20.0052])  # two steps: start and end each
    monkeypatch.setattr(cost_samples.time, "perf_counter", lambda: next(clock))
    verify = VerifyPlan([object()] * 4, [B] * 4, None)  # type: ignore[list-item, arg-type]
    samples.step_started()
    timings["draft_s"] += 0.003
    timings["verify_s"] += 0.006
    samples.step_ended(verify)  # 10 ms of wall, 9 of them the runner's: 1 ms of host
    decode = DecodePlan([object()] * 4)  # type: ignore[list-item]
    samples.step_started()
    timings["decode_s"] += 0.005
    samples.step_ended(decode)  # 5.2 ms, 5 the runner's
    got = {k: (round(s * 1e3, 6), n, c) for k, (s, n, c) in samples._host.items()}
    assert got == {"verify": (1.0, 4.0, 1), "plain": (0.2, 4.0, 1)}, got
    samples._pending.append((4, 4, 0, 0.0, 0.005, 0.0, 0, 1, 0))  # a cost sample is due: the host means go with it
    samples.feed()
    m = policy.cost
    fitted = {k: round(m.host_fit_s(k, 4) * 1e3, 3) for k in ("verify", "plain")}
    assert m.host["verify"].updates == m.host["plain"].updates == 1, fitted
    assert fitted["verify"] > fitted["plain"] > 0.0, f"one sample each moves the fits toward 1.0 / 0.2 ms: {fitted}"


@pytest.mark.parametrize("priced", [False, True])
def test_an_adaptive_engine_fits_its_host_time_by_kind_when_priced_and_verify_steps_always(trained_pair, priced):
    engine = cpu_engine(trained_pair.target, trained_pair.draft, max_num_seqs=4, speculation="adaptive")
    policy = engine.scheduler.policy
    assert policy is not None
    policy.cost.price_host = priced
    turns = [0]

    def alternating(req_ids, remaining):  # speculating and plain decisions in turn: both kinds of step
        policy.steps += 1
        turns[0] += 1
        return [B if turns[0] % 2 else 1] * len(req_ids)

    policy._choose = alternating  # type: ignore[method-assign]
    policy.reuse_plain = lambda min_remaining: False  # type: ignore[method-assign]
    for prompt in ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]):
        engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_work():
        engine.step()
    model = policy.summary()["host_ms_model"]
    if not priced:  # verify steps only, for the plain-regime test; the choice does not price them
        assert model["verify"]["fits"] >= 2 and model["plain"]["fits"] == 0, f"off: {model}"
        assert policy.cost.host_s("verify", 4) == 0.0 == policy.cost.host_s("plain", 4, regime=True)
        h = policy.cost.host_s("verify", 4, regime=True)
        assert 0.0 < h < 0.5, f"verify: {h * 1e3:.3f} ms a step of host time on the CPU: {model}"
        return
    assert model["verify"]["fits"] >= 2 and model["plain"]["fits"] >= 2, model
    for kind in ("verify", "plain"):
        h = policy.cost.host_s(kind, 4)
        assert 0.0 < h < 0.5, f"{kind}: {h * 1e3:.3f} ms a step of host time on the CPU: {model}"


def test_the_choice_prices_host_time_only_when_asked():
    # runner times alone: a c8 batch at acceptance 0.5 speculates; 3 ms of host a speculating step (against 0.1
    # for a plain one) makes it lose
    cost = CostModel.linear(5e-3, 1e-5, 8e-6, 1.2e-3, 7e-5, p0=4.6e-3, p1=1.2e-5)
    assert not cost.price_host, "not priced by default"
    tables = [geometric_table(0.5, B)] * 8
    assert choose_spans(tables, [100] * 8, B, cost).cap > 1
    for _ in range(20):
        cost.observe_host("verify", 8, 3e-3)
        cost.observe_host("plain", 8, 0.1e-3)
    assert choose_spans(tables, [100] * 8, B, cost).cap > 1, "host time fitted but not priced: the same choice"
    cost.price_host = True
    d = choose_spans(tables, [100] * 8, B, cost)
    assert d.cap == 1, f"priced: {d}, H_verify {cost.host_s('verify', 8) * 1e3:.2f} ms"


# accepted drafts of 16 blocks, first and later alike: position 1 accepted in half, each next one in half of those
# reaching it (then the 15): E(16) ~ 3.1 tokens a full block (the population's rates, shrunk)
HALVING_BLOCKS = [0] * 8 + [1] * 4 + [2] * 2 + [3, 15]


def _regime_policy(host_ms: float | None) -> AdaptivePolicy:
    """A policy past RETIRE_AFTER decisions without speculating, its first and later blocks HALVING_BLOCKS, on
    tiny-pair-like costs (a plain step ~0.7 ms, a c8 full-block draft + verify ~1.6 ms) where a uniform c8 batch
    drafting full blocks just wins on the runner's times; `host_ms`: each verify step's host time, observed."""
    pol = AdaptivePolicy(B)
    pol.cost = CostModel.linear(0.55e-3, 1e-5, 5e-7, 0.45e-3, 1e-4, p0=0.62e-3, p1=1e-5)
    for rep in range(3):
        for i, m in enumerate(HALVING_BLOCKS):
            pol.estimates.observe(rep * 100 + i, B, m, first=True)
            pol.estimates.observe(rep * 100 + i, B, m, first=False)
    pol.steps, pol._spec_at = RETIRE_AFTER + 1, 0
    for _ in range(20) if host_ms is not None else ():
        pol.cost.observe_host("verify", 8, host_ms * 1e-3)
    return pol


def test_a_large_batchs_plain_regime_prices_a_speculating_steps_host_time():
    # on the runner's times alone a uniform c8 batch drafting full blocks wins (E(16) ~ 3.1 tokens against a step
    # ~2.8 plain ones): no plain regime, so a dormant policy's new c8 requests are admitted awake; with 0.5 ms of
    # host a verify step (the H200's tiny pair measured 0.2-0.8 ms, run 152) plain wins and the regime holds. Small
    # batches' regime does not price it (there a thinner margin held choices plain: twenty-fourth session): at c1,
    # 2 ms of host a verify step would make plain win, and there is no regime.
    without, priced = _regime_policy(None), _regime_policy(0.5)
    for pol in (without, priced):
        assert not pol.cost.price_host and pol.cost.host_s("verify", 8) == 0.0, "the choice never prices it"
    assert without._find_plain_regime(8, False) is None, "no host time measured: speculation wins at c8"
    h = priced.cost.host_s("verify", 8, regime=True)
    got = priced._find_plain_regime(8, False)
    assert got is not None, f"H_verify(8) {h * 1e3:.2f} ms priced: a plain regime at c8"
    spec_s = uniform_spec_costs(8, B, priced.cost, priced.rows)[B]
    assert abs(got[1][B] - spec_s - h) < 1e-12, f"the regime's c8 full-block step {got[1][B]}: {spec_s} + {h}"
    dear = _regime_policy(2.0)
    c1_priced = uniform_spec_costs(1, B, dear.cost, dear.rows, regime=True)
    table = table_from_rates(dear.estimates.population_rates())
    assert plain_wins_uniformly(table, 1, dear.cost.plain_step_s(1), c1_priced), "c1 priced: plain would win"
    assert dear._find_plain_regime(1, False) is None, "c1: the regime test prices no host time"
