"""Dormancy (refengine/spec_decode/dormancy.py, Retirement.admit): after DORMANT_AFTER calm first blocks in a
retirement regime, judged in batches of the same kind, new requests are admitted retired (no taps at prefill,
no drafter context, no probe), except one whenever the admitted work's DORMANT_SHARE pays for a probe step;
that probe is not passed over by the probe sample, and a surprising block ends dormancy at once. In a plain
regime calm gathered in large batches does not make small ones dormant (a drafter whose first blocks are poor
and later ones good must still be probed on at c1: tests/unit/test_adaptive.py's
test_poor_first_blocks_do_not_lock_adaptive_into_plain); where position 1 fails everywhere it does. In
simulation with what each look costs on the H200, a settled tau-1 workload runs within 0.6% of plain. Where
nothing is known to fail and a wave's probe step is cheap beside its work, the policy stays awake
(Retirement._awake_is_cheap): a turn after a long poor stretch is then found on every random path. A block
drafted in a small batch leaves the large batches' calm alone (the bench's c1 cell before its c8 one).

Run: python -m pytest tests/unit/test_dormancy.py -q
"""

from __future__ import annotations

import pytest

from refengine.spec_decode.acceptance_estimate import SHORT_PROBE_EVIDENCE
from refengine.spec_decode.acceptance_profile import parse_profile
from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.dormancy import DORMANT_AFTER, DORMANT_PRICE, DORMANT_SHARE, Dormancy
from refengine.spec_decode.probe_sample import PROBE_SAMPLE
from refengine.spec_decode.retirement import RETIRE_AFTER
from refengine.spec_decode.step_costs import CostModel
from tests.unit.test_adaptive import _later_blocks_fail_too, _policy_with_failing_first_blocks, _simulate_phases
from tests.unit.test_surprise import B, _geometric_workload


def _probe_and_fail(pol: AdaptivePolicy, batch: list[int], tokens: int = 128) -> list[int]:
    """One step of `batch` (all new or retired): the probed requests' blocks accept nothing; then a decision
    that retires them (position 1 fails everywhere). Returns the indices that were probed."""
    spans = pol.choose(batch, [tokens] * len(batch))
    probed = [i for i, s in enumerate(spans) if s > 1]
    for i in probed:
        pol.observe_acceptance(batch[i], spans[i], 0)
    pol.choose(batch, [tokens - 1] * len(batch))
    missing = [r for r in batch if r not in pol.retired]
    assert not missing, f"requests {missing} did not retire after a failing step: {pol.summary()['retired_by']}"
    pol.take_retired()  # (as the scheduler does, freeing their drafter contexts)
    return probed


def _calm_at_c1() -> tuple[AdaptivePolicy, int]:
    """A policy in the position-1-fails regime that probed DORMANT_AFTER requests one at a time, each failing."""
    pol, rid = _policy_with_failing_first_blocks()
    rid = _later_blocks_fail_too(pol, rid)
    for k in range(DORMANT_AFTER):
        assert not pol.dormancy.dormant(1), f"dormant after {k} calm first blocks"
        assert not pol.admit(rid, 128, 128, 1), f"request {rid} admitted retired before dormancy"
        assert _probe_and_fail(pol, [rid]) == [0], f"request {rid}: a lone new request is probed"
        pol.release(rid)
        rid += 1
    return pol, rid


def test_a_calm_poor_workload_admits_requests_retired_and_probes_what_the_credit_pays():
    pol, rid = _calm_at_c1()
    assert pol.dormancy.dormant(1), pol.summary()["dormant"]
    assert not pol.dormancy.dormant(PROBE_SAMPLE), "in a plain regime calm at c1 says nothing of a larger batch"
    assert pol.dormancy.dormant(PROBE_SAMPLE, fails=True), "where nothing is accepted, calm at any batch counts"
    plain = pol.cost.plain_s(1)
    probe_s = pol.cost.draft_s(1) + pol.cost.verify_s(1, pol.rows(1, 2)) - plain + pol.cost.catch_up_s(128)
    n = 400
    expected = int(n * DORMANT_SHARE * 128 * plain / probe_s)
    retired = probed = 0
    for _ in range(n):
        if pol.admit(rid, 128, 128, 1):
            assert rid in pol.retired and pol.take_retired() == [], "retired at admission: nothing for the scheduler"
            retired += 1
        else:
            assert _probe_and_fail(pol, [rid]) == [0], f"request {rid}: the credit's probe drafts"
            probed += 1
        pol.release(rid)
        rid += 1
    assert 1 <= probed and abs(probed - expected) <= 1, f"{probed} probes in {n} requests, expected {expected}"
    want = {
        "admitted": retired,
        "probes": probed,
        "calm": [DORMANT_AFTER + probed, 0],
        "entered": [True, False],
        "doubts": {"opened": 0, "confirmed": 0, "open": False},  # (large batches' only)
    }
    assert pol.summary()["dormant"] == want
    assert pol.summary()["retired_by"]["dormant / batch 1"] == retired


def test_the_sample_keeps_a_dormant_probe_and_its_surprise_ends_dormancy():
    pol, rid = _policy_with_failing_first_blocks()
    rid = _later_blocks_fail_too(pol, rid)
    waves = 0
    while not pol.dormancy.dormant(PROBE_SAMPLE):  # waves of PROBE_SAMPLE: one sampled probe each
        batch = list(range(rid, rid + PROBE_SAMPLE))
        assert not any(pol.admit(r, 128, 128, PROBE_SAMPLE) for r in batch)
        assert len(_probe_and_fail(pol, batch)) == 1, "the sample probes one request of a wave"
        for r in batch:
            pol.release(r)
        rid += PROBE_SAMPLE
        waves += 1
    assert waves == DORMANT_AFTER and not pol.dormancy.dormant(1) and pol.dormancy.dormant(1, fails=True)
    probes = 0
    for _ in range(400):  # dormant waves until the credit has paid for two probes
        batch = list(range(rid, rid + PROBE_SAMPLE))
        rid += PROBE_SAMPLE
        admitted = [pol.admit(r, 128, 128, PROBE_SAMPLE) for r in batch]
        if all(admitted):
            for r in batch:
                pol.release(r)
            continue
        assert admitted.count(False) == 1, f"one probe a wave at most here: {admitted}"
        i = admitted.index(False)
        spans = pol.choose(batch, [128] * PROBE_SAMPLE)
        assert spans == [2 if k == i else 1 for k in range(PROBE_SAMPLE)], f"spans {spans}: the probe is kept"
        probes += 1
        if probes == 2:  # (the sample alone would have kept the first, its count then a multiple of PROBE_SAMPLE)
            pol.observe_acceptance(batch[i], 2, 1)  # position 1 accepted where it fails: a surprise
            break
        pol.observe_acceptance(batch[i], 2, 0)
        pol.choose(batch, [127] * PROBE_SAMPLE)
        pol.take_retired()
        for r in batch:
            pol.release(r)
    else:
        raise AssertionError(f"fewer than two dormant probes in 400 waves: {pol.summary()['dormant']}")
    assert not pol.dormancy.dormant(PROBE_SAMPLE) and pol.dormancy.calm == [0, 0], pol.summary()["dormant"]
    assert not any(pol.admit(r, 128, 128, PROBE_SAMPLE) for r in range(rid, rid + PROBE_SAMPLE)), "awake again"


@pytest.mark.parametrize("concurrency,waves", [(1, 200), (32, 20)])
def test_dormancy_takes_the_looks_off_a_settled_poor_workload(concurrency, waves):
    # the bench's tau 1 profile (nothing accepted) after a settle, with what the H200 showed each look costs
    # beside the probe step itself: a prefill writing taps (+2.4 ms at c1, run 96), decode steps writing them
    # (+0.04 ms), catch-ups (0.62 ms + 0.68 us a row). Dormant, adaptive is within 0.6% of plain; without
    # dormancy (every new request, or a sample of each wave, probed) 0.990 / 0.989
    profile = parse_profile("tau1.0")
    draw = lambda rng, span: profile.draw(rng, span)  # noqa: E731
    phases = [(32, draw, 10, 32), (concurrency, draw, waves, 128)]
    kw = dict(catch_up_fixed_s=0.62e-3, catch_up_row_s=0.68e-6, seeded=True, prefill_taps_s=2.4e-3, taps_s=0.04e-3)
    adaptive, plain = (_simulate_phases(m, phases, **kw)[-1] for m in ("adaptive", "plain"))
    assert adaptive >= 0.994 * plain, f"adaptive {adaptive:.1f}, plain {plain:.1f} tok/s ({adaptive / plain:.4f})"


def test_a_block_ordinary_in_large_batches_keeps_their_calm():
    # the bench's tau 1.3 profile (position 1 accepted in 30% of blocks, position 2 never) in its cells' order:
    # a c32 settle, then c1, then c8. At c1, while position 2 is not yet known to fail, a block accepting
    # position 1 is a surprise (small batches' rule); at c8-c32 it is an ordinary block (the odds rule). It
    # used to reset the calm of both kinds, and the c8 cell then probed a sample of every wave: 0.9918 of
    # plain; with calm kept by each kind's own rule 0.9988
    profile = parse_profile("tau1.3")
    draw = lambda rng, span: profile.draw(rng, span)  # noqa: E731
    kw = dict(catch_up_fixed_s=0.62e-3, catch_up_row_s=0.68e-6, seeded=True, prefill_taps_s=2.4e-3, taps_s=0.04e-3)
    phases = [(32, draw, 18, 128), (1, draw, 7, 128), (8, draw, 7, 128)]
    policies: list[AdaptivePolicy] = []
    adaptive = _simulate_phases("adaptive", phases, policies=policies, **kw)
    plain = _simulate_phases("plain", phases, **kw)
    dormant = policies[0].summary()["dormant"]
    ratio = adaptive[-1] / plain[-1]
    got = f"adaptive {adaptive[-1]:.1f}, plain {plain[-1]:.1f} tok/s ({ratio:.4f})"
    assert ratio >= 0.996, f"c8 after c1: {got}, {dormant}"
    assert dormant["admitted"] >= 7 * 8 - 8, f"the c8 cell was not dormant: {dormant}"


TINY_COSTS = CostModel.linear(0.55e-3, 1e-5, 5e-7, 0.7e-3, 1e-4, p0=0.62e-3, p1=1e-5)  # a plain step ~0.6 ms
TINY_LOOKS = dict(seeded=True, prefill_taps_s=0.54e-3, taps_s=6e-6, catch_up_fixed_s=0.5e-3, catch_up_row_s=0.5e-6)


def test_a_small_batchs_blocks_leave_the_large_batches_calm():
    # the trained tiny pair's bench with c1 first (H200 run 154: c8 0.887 of plain, awake): at c1 its generations
    # turn good (text loops) and blocks accept up to 15, past large batches' rare count. Those blocks reset the
    # large calm, and the c8 cell after it ran awake. Simulated (tiny costs, every request's drafts accepted at
    # 0.35 (0.3 in its first block) until its 24th token, then 0.95, except one request in four, which stays
    # poor: a c8 wave waits for it and fixed spans run 0.55 of plain), c8 / c16 after c1 read 0.943 / 0.985 of
    # plain with the reset, 0.960 / 0.996 without (paths 1-4); at c8 the c1 cell's rates still wake the cell
    # (no plain regime at c8 on them)
    kw = dict(p_first=0.3, switch=(24, 0.95), poor_every=4, true=TINY_COSTS, **TINY_LOOKS)
    phases = [(32, 0.35, 30, 128), (1, 0.35, 8, 128), (8, 0.35, 8, 128), (16, 0.35, 8, 128)]
    for seed in (1, 2):
        policies: list[AdaptivePolicy] = []
        adaptive = _simulate_phases("adaptive", phases, policies=policies, seed=seed, **kw)
        plain = _simulate_phases("plain", phases, seed=seed, **kw)
        c16 = adaptive[3] / plain[3]
        dormant = policies[0].summary()["dormant"]
        assert c16 >= 0.99, f"path {seed}: c16 after c1 and c8 {c16:.3f} of plain, {dormant}"
    large_calm = []
    for phase in ([phases[0]], phases[:2]):  # the large calm after the c32 settle, then after the c1 cell
        policies = []
        _simulate_phases("adaptive", phase, policies=policies, seed=1, **kw)
        large_calm.append(policies[0].dormancy.calm[1])
    assert large_calm[0] >= DORMANT_AFTER and large_calm[1] >= large_calm[0], f"large calm {large_calm}"


def test_each_kind_of_batch_loses_its_calm_by_its_own_rule():
    d = Dormancy(calm=[DORMANT_AFTER, DORMANT_AFTER])
    d.observe_first_block(1, (True, False), retiring_batch=PROBE_SAMPLE)  # ordinary in a large batch
    d.surprise(True, False)
    assert d.calm == [0, DORMANT_AFTER + 1], f"calm {d.calm}: a surprise by small batches' rule only"
    d.observe_first_block(2, (False, False), retiring_batch=1)
    assert d.calm == [1, DORMANT_AFTER + 1], d.calm
    d.surprise(True, True)
    assert d.calm == [0, 0], f"calm {d.calm}: a block past large batches' odds surprises both"


def test_a_turn_after_a_long_poor_stretch_is_found_on_every_path():
    # waves going from geometric 0.25 (plain wins, nothing known to fail) to 0.85 after 20 waves, six random
    # paths: dormant, a turn is seen only through the probes DORMANT_SHARE of the work pays for; at c32 every
    # path went dormant and read 0.50-0.99 of the better mode after the turn, at c8 two of six (0.33, 0.65).
    # Staying awake where a probe step is cheap (Retirement._awake_is_cheap): 0.96-1.02 at c32, 0.80-1.07 at c8
    # (the c8 paths below 0.9 are not dormancy's: they read the same either way), the poor phase >= 0.988
    for c, after in ((8, 10), (32, 6)):
        poor, turn = [], []
        for seed in range(1, 7):
            phases = [(c, 0.25, 20, 128), (c, 0.85, after, 128)]
            got = {m: _simulate_phases(m, phases, seed=seed) for m in ("adaptive", "plain", "fixed")}
            poor.append(got["adaptive"][0] / max(got["plain"][0], got["fixed"][0]))
            turn.append(got["adaptive"][1] / max(got["plain"][1], got["fixed"][1]))
        shown = f"c{c}: poor phase {[round(r, 3) for r in poor]}, after the turn {[round(r, 3) for r in turn]}"
        assert min(poor) >= 0.985, shown
        if c == 32:
            assert min(turn) >= 0.95, shown
        else:
            assert min(turn) >= 0.78 and sum(turn) / len(turn) >= 0.9, shown


def _calm_plain_regime_at_c32() -> AdaptivePolicy:
    """A plain regime at c32 (geometric 0.2: nothing known to fail), calm enough for dormancy in both kinds of
    batch, after a choice for 32 requests."""
    pol, rid = _geometric_workload(0.2)
    pol._spec_at = pol.steps - RETIRE_AFTER
    pol.choose(list(range(rid, rid + 32)), [500] * 32)
    pol.dormancy.calm = [DORMANT_AFTER, DORMANT_AFTER]
    return pol


def test_a_cheap_probe_keeps_a_wave_awake_where_nothing_is_known_to_fail():
    # a plain regime at c32 (geometric 0.2: nothing known to fail), calm enough for dormancy: a wave of 32 new
    # requests whose probe step costs under DORMANT_PRICE of their plain time stays awake; one arrival alone (a
    # probe step against one request's work), or the same wave where position 1 fails everywhere, is admitted
    # retired as before
    pol = _calm_plain_regime_at_c32()
    est = pol.estimates
    assert min(est.failing_span(), est.failing_span(later=True)) == B and pol._plain_regime(32, False) is not None
    assert not pol.admit(1000, 128, 128, 32, arriving=32), "a wave whose probe step is cheap was admitted retired"
    assert pol.admit(1001, 128, 128, 32, arriving=1), "a lone arrival was not admitted retired"
    assert pol._awake_is_cheap(1e-3, 1.0, fails=False) and not pol._awake_is_cheap(1e-3, 1.0, fails=True)
    assert not pol._awake_is_cheap(DORMANT_PRICE * 1.0, 1.0, fails=False), "a probe at the price is not cheap"


def test_a_position_failing_on_half_the_evidence_and_an_entered_dormancy_keep_it():
    # the bench's tau 1.3 profile (position 2 never accepted) holds position 2's evidence near the count
    # failing_span asks, as it is tested only when position 1 accepts: with failing_span's test the rule woke
    # the H200's c32 cell for most waves (32 of 256 requests admitted retired, run 142)
    pol = _calm_plain_regime_at_c32()
    est = pol.estimates
    est.accepted[1], est.tested[1] = 0.0, SHORT_PROBE_EVIDENCE / 2  # position 2: never accepted, thin evidence
    est.observations += 1  # (a new population version: its memoised rates are stale)
    assert est.failing_span() == B, "failing_span should not know position 2 fails on this evidence"
    assert not pol._awake_is_cheap(1e-3, 1.0, fails=False), "position 2 fails on half the evidence: not cheap"
    assert pol.admit(1000, 128, 128, 32, arriving=32) and pol.dormancy.entered == [False, True]
    est.tested[1] = 0.0  # the evidence gone: nothing known to fail, a cheap probe; dormancy entered stays
    est.observations += 1
    assert pol._awake_is_cheap(1e-3, 1.0, fails=False)
    assert pol.admit(1001, 128, 128, 32, arriving=32), "an entered dormancy asked the rule again"
    pol.dormancy.surprise(False, True)
    pol.dormancy.calm = [DORMANT_AFTER, DORMANT_AFTER]
    assert pol.dormancy.entered == [False, False] and not pol.admit(1002, 128, 128, 32, arriving=32), "after a surprise"
