"""A large batch's rare blocks judged together where a probe step is dear (RareBlocks._rare_together,
refengine/spec_decode/rare_blocks.py): with every request of a c32 wave probed, one first block past the count
blocks of its kind reach in under SURPRISE_ODDS of cases is what 32 blocks give most steps, not a surprise; it
takes rare_in_many(32) of them. Each such surprise held off the plain regime for a wave, so a wave of new
requests was probed again, and one prompt's first block surprised again (the H200's trained tiny pair, run 136:
no calm, no dormancy, a c8 cell paying its probes). Where a probe step is cheap beside the batch's work, each
block is judged alone as before: false alarms cost little there, and they find turns sooner. The price is
taken against the batch's whole budgets, which the policy keeps for running requests only.

Run: python -m pytest tests/unit/test_rare_together.py -q
"""

from __future__ import annotations

import math

import pytest

from refengine.errors import IntegrityError
from refengine.request import SamplingParams
from refengine.spec_decode.rare_blocks import SURPRISE_ODDS, rare_in_many
from refengine.spec_decode.step_costs import CostModel
from tests.adapter import cpu_engine
from tests.unit.test_adaptive import _simulate_phases
from tests.unit.test_surprise import B, _geometric_workload


def _binomial_tail(k: int, c: int, p: float) -> float:
    """P(Binomial(k, p) >= c), summed term by term."""
    return sum(math.comb(k, j) * p**j * (1 - p) ** (k - j) for j in range(c, k + 1))


def test_rare_in_many_is_the_fewest_rare_blocks_a_step_of_k_reaches_under_the_odds():
    assert [rare_in_many(k) for k in (0, 1, 2, 8, 32)] == [1, 1, 2, 3, 5]
    for k in range(1, 65):
        c = rare_in_many(k)
        tail, below = _binomial_tail(k, c, SURPRISE_ODDS), _binomial_tail(k, c - 1, SURPRISE_ODDS)
        assert tail <= SURPRISE_ODDS and (c == 1 or below > SURPRISE_ODDS), (
            f"k {k}: c {c}, P(>= c) {tail:.4f}, P(>= c - 1) {below:.4f}"
        )


def _dear_probe_costs() -> CostModel:
    """The simulation's costs with a draft of 8 ms: a c32 probe step ~7.7 ms over plain's 5, above DORMANT_PRICE
    of a 128-token wave's plain time (4.5 ms)."""
    return CostModel.linear(5e-3, 1e-5, 8e-6, 8e-3, 7e-5, p0=4.6e-3, p1=1.2e-5)


def test_one_rare_first_block_among_a_waves_probes_surprises_only_where_a_probe_is_cheap():
    for dear in (True, False):
        pol, rid = _geometric_workload(0.2, cost=_dear_probe_costs() if dear else None)
        batch = list(range(rid, rid + 32))
        spans = pol.choose(batch, [128] * 32)
        probed = [r for r, s in zip(batch, spans) if s > 1]
        assert len(probed) == 32, f"outside a plain regime every new request is probed: {len(probed)} of 32"
        rare, need = pol.estimates.unlikely_count(True, SURPRISE_ODDS), rare_in_many(32)
        assert 1 < rare < B and need > 1, (rare, need)
        spec_at = pol._spec_at
        pol.observe_acceptance(probed[0], B, rare)
        if not dear:
            assert pol._spec_at == pol.steps, "a cheap probe: one rare block is a surprise, as before"
            assert pol.summary()["rare_blocks_judged_together"] == {"blocks": 0, "surprising": 0}
            continue
        assert pol._spec_at == spec_at, f"a dear probe: 1 rare first block of 32 surprised (needs {need})"
        for r in probed[1 : need - 1]:
            pol.observe_acceptance(r, B, rare)
        assert pol._spec_at == spec_at, f"{need - 1} rare first blocks of 32 surprised (needs {need})"
        pol.observe_acceptance(probed[need - 1], B, rare)
        assert pol._spec_at == pol.steps, f"{need} rare first blocks of 32 did not surprise"
        shown = pol.summary()["rare_blocks_judged_together"]
        assert shown == {"blocks": need, "surprising": 1}, f"stats {shown}"


# the first blocks of the bench's one batch of prompts (the same 32 every c32 wave): one accepting 3 in 32, a few
# 1-2 (run 136 saw one prompt's block at the rare count every wave); later blocks geometric
FIXED_FIRST_BLOCKS = [3, 0, 1, 0, 0, 2, 0, 0, 1, 0, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 2, 0, 0, 1, 0, 0, 0]


class _FixedBatch:
    """A profile draw (rng, span) -> accepted drafts: the fixed first blocks in turn, as the bench repeats them."""

    def __init__(self) -> None:
        self.drawn = 0

    def __call__(self, rng, span: int) -> int:
        m = FIXED_FIRST_BLOCKS[self.drawn % len(FIXED_FIRST_BLOCKS)]
        self.drawn += 1
        return min(m, span - 1)


def test_a_short_c32_settle_on_one_batch_of_prompts_leaves_the_next_cells_dormant():
    # the bench's order on tiny-pair-like costs (a draft + verify ~2 plain steps, a probe's catch-up 0.5 ms + its
    # prompt's rows, taps at prefill 0.54 ms: a probe step dear beside a wave's work): 11 c32 settle waves, then
    # c8 / c16 / c32 cells of 9 waves. Judged alone, the settle's rare block each wave held off the plain regime
    # and on path 2 the c8 / c16 cells ran 0.971 / 0.975 of plain, the settle 0.933-0.944 on paths 1-3; judged
    # together, 0.998-1.000 and 0.957-0.963
    tiny = CostModel.linear(0.55e-3, 1e-5, 5e-7, 0.7e-3, 1e-4, p0=0.62e-3, p1=1e-5)
    looks = dict(seeded=True, prefill_taps_s=0.54e-3, taps_s=6e-6, catch_up_fixed_s=0.5e-3, catch_up_row_s=0.5e-6)
    phases = [(32, 0.5, 11, 128), (8, 0.5, 9, 128), (16, 0.5, 9, 128), (32, 0.5, 9, 128)]
    for seed in (1, 2, 3):
        got = {
            m: _simulate_phases(m, phases, p_first=_FixedBatch(), true=tiny, seed=seed, **looks)
            for m in ("adaptive", "plain")
        }
        ratios = [round(a / p, 3) for a, p in zip(got["adaptive"], got["plain"])]
        assert ratios[0] >= 0.95 and min(ratios[1:]) >= 0.99, f"path {seed}: adaptive / plain by phase {ratios}"


def test_the_policy_keeps_a_budget_for_running_requests_only(trained_pair):
    # _rare_together prices a probe against each request's whole budget, recorded at admission: finished,
    # aborted and rolled-back requests leave none behind (check_integrity says so between steps)
    engine = cpu_engine(trained_pair.target, trained_pair.draft, speculation="adaptive", num_blocks=64)
    policy = engine.scheduler.policy
    assert policy is not None
    reqs = [
        engine.add_request([5 + i, 9, 13, 2 * i + 1], SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True))
        for i in range(3)
    ]
    engine.step()  # the prefill admits all three
    assert policy.budgets == {r.request_id: 6 + 2 * i for i, r in enumerate(reqs)}, policy.budgets
    assert engine.abort(reqs[1].request_id)
    engine.check_integrity()
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    assert policy.budgets == {}, f"budgets left behind: {policy.budgets}"
    policy.budgets[reqs[0].request_id] = 6  # a leak: a finished request's budget
    with pytest.raises(IntegrityError, match="budgets"):
        engine.check_integrity()
