"""The host's share of a step in the adaptive policy's costs (refengine/spec_decode/cost_samples.py, step_costs.py
H_verify / H_plain). Checks that:
- CostSamples counts a step's host time as its wall time less the runner's synchronised work, by kind of step,
  and hands the means over with the cost samples;
- an adaptive CPU engine with CostModel.price_host fits both kinds from its own steps (host_ms_model in the
  policy's stats), and without it measures nothing (the measurement costs host time itself);
- the choice prices them only with price_host (off by default: no gain measured on the H200, docs/PERF.md), and
  then a speculating choice that wins on the runner's times alone, but not once its extra host time is paid, is
  plain.

Run: python -m pytest tests/unit/test_host_costs.py -q
"""

from __future__ import annotations

import pytest

from refengine import SamplingParams
from refengine.plan import DecodePlan, VerifyPlan
from refengine.spec_decode import cost_samples
from refengine.spec_decode.acceptance_estimate import geometric_table
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.cost_samples import BUSY, TIMINGS, CostSamples
from refengine.spec_decode.span_choice import choose_spans
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
    fitted = {k: round(m._host_fit_s(k, 4) * 1e3, 3) for k in ("verify", "plain")}
    assert m.host["verify"].updates == m.host["plain"].updates == 1, fitted
    assert fitted["verify"] > fitted["plain"] > 0.0, f"one sample each moves the fits toward 1.0 / 0.2 ms: {fitted}"


@pytest.mark.parametrize("priced", [False, True])
def test_an_adaptive_engine_fits_its_steps_host_time_when_priced(trained_pair, priced):
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
    if not priced:
        assert model["verify"]["fits"] == model["plain"]["fits"] == 0, f"measured while off: {model}"
        assert policy.cost.host_s("verify", 4) == 0.0
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
