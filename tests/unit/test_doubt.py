"""A lone rare block's doubt (RareBlocks._doubt, refengine/spec_decode/rare_blocks.py): in a large batch where a
probe step is dear, a block past the rare count drafted alone in its step (a dormant policy's probe, an awake
c8 wave's sampled one) is not a surprise by itself, as 1 in 20 blocks is one by the count's definition; it opens
a doubt that keeps the policy awake (its new requests probed) until the blocks after it settle it: one more rare
block among the next DOUBT_BLOCKS - 1 is a surprise, none a false alarm, and dormancy resumes with its calm
intact. Judged alone, each such block reset the calm, and at the trained tiny pair's c8 (one probe a wave) the
cell stayed awake for ~25 waves (H200 run 150: one process's c8 cell 0.960 of plain). Where a probe is cheap the
lone block is a surprise at once, as before.

Run: python -m pytest tests/unit/test_doubt.py -q
"""

from __future__ import annotations

from refengine.spec_decode.dormancy import DORMANT_AFTER
from refengine.spec_decode.exploration import PROBE_HOLD
from refengine.spec_decode.probe_sample import PROBE_SAMPLE
from refengine.spec_decode.rare_blocks import DOUBT_BLOCKS, SURPRISE_ODDS
from refengine.spec_decode.step_costs import CostModel
from tests.unit.test_adaptive import _simulate_phases
from tests.unit.test_rare_together import _dear_probe_costs
from tests.unit.test_surprise import B, _geometric_workload


def _lone_probes(dear: bool):
    """A poor workload (geometric 0.2) with a batch of PROBE_SAMPLE whose requests drafted their first blocks
    (calm); then each call of the returned probe(accepted) admits one new request into the batch in place of the
    oldest, which alone drafts its first block and accepts `accepted`. Returns the policy, probe and the rare
    count of first blocks."""
    pol, rid = _geometric_workload(0.2, cost=_dear_probe_costs() if dear else None)
    batch = list(range(rid, rid + PROBE_SAMPLE))
    spans = pol.choose(batch, [128] * PROBE_SAMPLE)
    assert all(s > 1 for s in spans), f"outside a plain regime every new request is probed: {spans}"
    for r in batch:
        pol.observe_acceptance(r, B, 0)
    nxt = [rid + PROBE_SAMPLE]

    def probe(accepted: int) -> None:
        pol.release(batch.pop(0))
        batch.append(nxt[0])
        nxt[0] += 1
        drafting: list[int] = []
        for _ in range(PROBE_HOLD + 1):  # (a lone new request waits PROBE_HOLD steps for company to probe with)
            spans = pol.choose(batch, [128] * PROBE_SAMPLE)
            drafting = [r for r, s in zip(batch, spans) if s > 1]
            if drafting:
                break
        assert drafting == [batch[-1]], f"the new request alone drafts: {drafting}"
        pol.observe_acceptance(batch[-1], B, accepted)

    return pol, probe, pol.estimates.unlikely_count(True, SURPRISE_ODDS)


def test_a_lone_rare_block_where_probes_are_dear_opens_a_doubt_that_calm_blocks_clear():
    pol, probe, rare = _lone_probes(dear=True)
    pol.dormancy.calm[1] = DORMANT_AFTER  # dormant in large batches
    assert pol.dormancy.dormant(PROBE_SAMPLE)
    spec_at = pol._spec_at
    probe(rare)
    assert pol._spec_at == spec_at, "a lone rare block surprised where a probe is dear"
    assert pol.dormancy.doubt == [1, 1], f"no doubt opened: {pol.dormancy.doubt}"
    assert not pol.dormancy.dormant(PROBE_SAMPLE), "dormant while a doubt is open: nothing would settle it"
    for i in range(DOUBT_BLOCKS - 1):
        probe(0)
        closed = pol.dormancy.doubt is None
        assert closed == (i == DOUBT_BLOCKS - 2), f"after {i + 1} calm blocks: {pol.dormancy.doubt}"
    assert pol._spec_at == spec_at and pol.dormancy.calm[1] == DORMANT_AFTER, "a false alarm reset the calm"
    assert pol.dormancy.dormant(PROBE_SAMPLE), "dormancy did not resume after the doubt cleared"
    assert pol.summary()["dormant"]["doubts"] == {"opened": 1, "confirmed": 0, "open": False}


def test_a_second_rare_block_in_the_doubt_is_a_surprise():
    pol, probe, rare = _lone_probes(dear=True)
    pol.dormancy.calm[1] = DORMANT_AFTER
    probe(rare)
    probe(0)
    probe(rare)  # 2 of 3 blocks past the rare count: rare_in_many(3) = 2
    assert pol._spec_at == pol.steps, "two rare blocks of three did not surprise"
    assert pol.dormancy.calm[1] == 0 and pol.dormancy.doubt is None, (pol.dormancy.calm, pol.dormancy.doubt)
    assert pol.summary()["dormant"]["doubts"] == {"opened": 1, "confirmed": 1, "open": False}


def test_a_lone_rare_block_where_probes_are_cheap_surprises_at_once():
    pol, probe, rare = _lone_probes(dear=False)
    pol.dormancy.calm[1] = DORMANT_AFTER
    probe(rare)
    assert pol._spec_at == pol.steps and pol.dormancy.calm[1] == 0, "a cheap probe's rare block did not surprise"
    assert pol.dormancy.doubt is None and pol.summary()["dormant"]["doubts"]["opened"] == 0


def test_a_dormant_probes_false_alarm_late_in_the_settle_does_not_wake_the_c8_cell():
    # the bench's order on tiny-pair-like costs (test_rare_together's), a settle of 48 c32 waves as the bench's
    # default gives the adaptive engine (first blocks geometric 0.3), then c8 / c16 / c32 cells of 18 waves. On
    # this path a dormant probe's first block past the rare count came late in the settle: judged alone it reset
    # the calm, and at one probe a c8 wave the c8 / c16 cells ran 0.986 / 0.995 of plain; in doubt 0.994 / 0.999
    tiny = CostModel.linear(0.55e-3, 1e-5, 5e-7, 0.7e-3, 1e-4, p0=0.62e-3, p1=1e-5)
    looks = dict(seeded=True, prefill_taps_s=0.54e-3, taps_s=6e-6, catch_up_fixed_s=0.5e-3, catch_up_row_s=0.5e-6)
    phases = [(32, 0.5, 48, 128), (8, 0.5, 18, 128), (16, 0.5, 18, 128), (32, 0.5, 18, 128)]
    pols: list = []
    got = {
        m: _simulate_phases(m, phases, p_first=0.3, true=tiny, seed=7, policies=pols, **looks)
        for m in ("adaptive", "plain")
    }
    ratios = [round(a / p, 4) for a, p in zip(got["adaptive"], got["plain"])]
    doubts = pols[0].dormancy.doubts
    assert doubts[0] >= 1, f"no doubt opened on this path ({doubts}): the test no longer exercises it"
    assert min(ratios[1:]) >= 0.99, f"adaptive / plain by phase {ratios} (doubts opened, confirmed: {doubts})"
