"""What counts as a surprising block (Retirement._surprising, refengine/spec_decode/retirement.py): in a batch of
PROBE_SAMPLE or more while no draft position is known to fail, only a block accepting as many drafts as blocks
of its kind reach in under SURPRISE_ODDS of cases (AcceptanceEstimates.unlikely_count), so a drafter that
accepts some of the time (the trained tiny pair) can still settle into a plain regime where plain wins; in small
batches, or where a position is known to fail, any block past the failing position (or accepting anything) is.
With it, in simulation: stationary poor workloads lose less to plain, and a workload turning good is still
found within a wave. And in such a batch's plain regime a request done being probed retires whatever its own
blocks (no decision found its drafting worth a step).

Run: python -m pytest tests/unit/test_surprise.py -q
"""

from __future__ import annotations

import random

from refengine.spec_decode.acceptance_estimate import AcceptanceEstimates
from refengine.spec_decode.adaptive import RETIRE_AFTER, AdaptivePolicy
from refengine.spec_decode.probe_sample import PROBE_SAMPLE
from refengine.spec_decode.rare_blocks import SURPRISE_ODDS
from refengine.spec_decode.span_choice import plain_wins_uniformly, uniform_spec_costs
from refengine.spec_decode.step_costs import CostModel
from tests.unit.test_adaptive import _simulate_phases

B = 16


def _simulation_costs() -> CostModel:
    """The simulation's default costs (a draft + verify of 8 or 32 requests at full span ~1.5-2 plain steps);
    a fresh model each time: a policy's observations update it."""
    return CostModel.linear(5e-3, 1e-5, 8e-6, 1.2e-3, 7e-5, p0=4.6e-3, p1=1.2e-5)


def _geometric_workload(alpha: float, seed: int = 3, cost: CostModel | None = None) -> tuple[AdaptivePolicy, int]:
    """A policy whose first and later blocks accept each draft with `alpha` (geometric), on ample evidence, with
    both cost curves measured (`cost`, default the simulation's) and no exploration due. Returns it and the next
    request id."""
    pol = AdaptivePolicy(B, cost=cost or _simulation_costs())
    pol.cost.plain.updates = pol.cost.verify.updates = 1
    pol._next_explore = 10**9
    rng = random.Random(seed)
    for rid in range(-1, -201, -1):
        for _ in range(2):  # its first block, then a later one
            m = 0
            while m < B - 1 and rng.random() < alpha:
                m += 1
            pol.observe_acceptance(rid, B, m)
        pol.release(rid)
    return pol, 0


def test_unlikely_count_is_the_fewest_drafts_reached_under_the_odds():
    est = AcceptanceEstimates(B)
    for _ in range(400):  # position 1 accepts half the time, position 2 never
        for first in (True, False):
            est.observe(1, 3, 1, first)
            est.observe(2, 3, 0, first)
    assert est.unlikely_count(True, SURPRISE_ODDS) == 2 and est.unlikely_count(False, SURPRISE_ODDS) == 2
    sure = AcceptanceEstimates(B)
    for _ in range(400):
        sure.observe(1, B, B - 1, True)
    assert sure.unlikely_count(True, SURPRISE_ODDS) == B, "every block accepts all: no count is rare"


def test_large_batches_with_nothing_failing_judge_blocks_by_the_workloads_odds():
    pol, rid = _geometric_workload(0.4)
    est = pol.estimates
    assert min(est.failing_span(), est.failing_span(later=True)) == B, "nothing is known to fail"
    k_first, k_later = est.unlikely_count(True, SURPRISE_ODDS), est.unlikely_count(False, SURPRISE_ODDS)
    assert 2 < k_first < B and 2 < k_later < B, (k_first, k_later)
    pol.choose(list(range(rid, rid + PROBE_SAMPLE)), [500] * PROBE_SAMPLE)
    assert not pol._surprising(1, True) and not pol._surprising(k_later - 1, False), "common blocks"
    assert pol._surprising(k_first, True) and pol._surprising(k_later, False), "rare blocks"
    pol.choose([rid], [500])  # a small batch: any accepted draft is past what nothing-known-to-fail predicts
    assert pol._surprising(1, True) and pol._surprising(1, False)


def test_a_common_block_in_a_large_batch_does_not_hold_off_the_plain_regime():
    pol, rid = _geometric_workload(0.2)  # plain wins at c32 under these costs
    batch = list(range(rid, rid + 32))
    pol._spec_at = pol.steps - RETIRE_AFTER
    pol.choose(batch, [500] * 32)
    before = pol._spec_at
    pol.observe_acceptance(batch[0], B, 1)  # accepts one draft: a fifth of blocks do
    assert pol._spec_at == before, "a block accepting what a fifth of blocks accept is no surprise at c32"
    pol.observe_acceptance(batch[1], B, B - 1)  # accepts all: never seen at 0.2
    assert pol._spec_at == pol.steps, "a block accepting all 15 drafts is"


def test_turns_are_still_found_and_stationary_poor_workloads_keep_near_plain():
    # a c8 / c32 workload going from geometric 0.25 (plain wins) to 0.85 (speculation wins): measured on this
    # simulation when the rule was written, 0.993 / 1.029 at c8 and 0.985 / 1.017 at c32 of the better mode per
    # phase (with any accepted draft a surprise: 0.989 / 1.054 and 0.981 / 1.035; with no surprises at all in
    # large batches the turn ran 0.857 and 0.770)
    for c, waves in ((8, (20, 10)), (32, (10, 6))):
        phases = [(c, 0.25, waves[0], 128), (c, 0.85, waves[1], 128)]
        got = {m: _simulate_phases(m, phases) for m in ("adaptive", "plain", "fixed")}
        for i, floor in ((0, 0.975), (1, 1.0)):
            best = max(got["plain"][i], got["fixed"][i])
            assert got["adaptive"][i] >= floor * best, (
                f"c{c} phase {i}: adaptive {got['adaptive'][i]:.0f}, plain {got['plain'][i]:.0f}, "
                f"fixed {got['fixed'][i]:.0f} tok/s ({got['adaptive'][i] / best:.3f} of the better)"
            )


def test_a_large_batch_in_a_plain_regime_retires_its_probed_requests_whatever_their_own_blocks():
    # at c32 no decision speculates, so a request whose own estimate is good (alone, a batch like it would
    # speculate), with follow-up probes due that the budget does not afford, still retires: one request still
    # capturing keeps the whole batch on the decode graph with taps (H200, the trained tiny pair at c32, runs
    # 92 and 93: 10-12 of 198 probed requests)
    pol, rid = _geometric_workload(0.2)
    batch = list(range(rid, rid + 32))
    pol._spec_at = pol.steps - RETIRE_AFTER  # a plain regime already
    spans = pol.choose(batch, [500] * 32)
    probed = [r for r, s in zip(batch, spans) if s > 1]
    assert probed and len(probed) < 32, f"spans {spans}"
    for r in probed:  # the first accepts something: follow-ups would be due (_probing), the budget affords none
        pol.observe_acceptance(r, B, 1 if r == probed[0] else 0)
    pol.regret_s = 1e9
    good = probed[0]
    assert pol._probing(good)
    own = pol.estimates.requests[good]  # its own evidence says it accepts nearly everything (set directly:
    for k in range(B - 1):  # as blocks, these would be surprises and end the regime)
        own[0][k], own[1][k] = 40.0, 40.0
    pol._version += 1
    table = pol.estimates.tables([good])[0]
    plain_s, costs = pol.cost.plain_s(32), uniform_spec_costs(32, B, pol.cost, pol.rows)
    assert not plain_wins_uniformly(table, 32, plain_s, costs), "its own estimate alone would speculate"
    assert pol.choose(batch, [499] * 32) == [1] * 32
    assert pol.retired == set(batch), f"{32 - len(pol.retired)} of 32 not retired"
