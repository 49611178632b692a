"""GoodputSpans (refengine/span_policy/goodput.py) on synthetic step costs and acceptance, stated as
properties: full spans where drafts are accepted, span 1 where none are (tau 1), no speculation where the
predicted gain over plain is under SPEC_MARGIN, exploration held within EXPLORE_BUDGET of the time run, a
closed batch priced by its drain time (its slowest request) and an open one by tokens a second, a repeated
decision held between searches; its cost table (seeds replaced by the first measurement, unmeasured seeds
priced with the host's measured share, unseen shapes priced by a line) and acceptance estimates (a new request
starts at the population's rate, a measured one moves to its own).

Run: python -m pytest tests/unit/test_goodput_spans.py -q
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from refengine.span_policy import StepReport
from refengine.span_policy.acceptance import PRIOR_WEIGHT, AcceptanceEstimates
from refengine.span_policy.base import ShapeCost, StepShapes
from refengine.span_policy.goodput import EXPLORE_BUDGET, SPEC_MARGIN, GoodputSpans
from refengine.span_policy.step_costs import StepCosts

B = 16


def _policy(plain_ms: float = 1.0, verify_ms: float = 1.1, draft_ms: float = 0.3, per_row_ms: float = 0.0):
    """A policy whose step costs are fixed: P = plain, V = verify + per_row x rows, D = draft (ms)."""
    pol = GoodputSpans(B)

    def get(kind: str, bucket: int, cap: int, floor: bool = False) -> float:  # no replays: floor = estimate
        if kind == "decode":
            return plain_ms * 1e-3
        if kind == "draft":
            return draft_ms * 1e-3
        return (verify_ms + per_row_ms * bucket * cap) * 1e-3

    pol.costs.get = get  # type: ignore[method-assign]
    return pol


def _feed(pol: GoodputSpans, req_ids, accept, blocks: int = 20, span: int = B) -> None:
    """`blocks` steps in which every request drafted a block accepting `accept(rid)` drafts."""
    for _ in range(blocks):
        pol.estimates.advance()
        pol.observe(StepReport(tuple(req_ids), (span,) * len(req_ids), tuple(accept(r) for r in req_ids), None, None))


def _admit(pol: GoodputSpans, n: int, budget: int = 256) -> list[int]:
    for rid in range(n):
        pol.admit(rid, budget)
    return list(range(n))


@pytest.mark.parametrize("n", [1, 8, 32])
def test_full_spans_at_high_acceptance(n):
    pol = _policy()
    ids = _admit(pol, n)
    _feed(pol, ids, lambda r: B - 1)
    assert pol.choose(ids, [200] * n) == [B] * n


@pytest.mark.parametrize("n", [1, 8, 32])
def test_span_one_at_tau_one(n):
    pol = _policy(verify_ms=1.05, draft_ms=0.1)  # drafting nearly free: still no gain without acceptance
    ids = _admit(pol, n)
    _feed(pol, ids, lambda r: 0)
    assert pol.choose(ids, [200] * n) == [1] * n


def test_budgets_cap_the_spans():
    pol = _policy()
    ids = _admit(pol, 3)
    _feed(pol, ids, lambda r: B - 1)
    spans = pol.choose(ids, [1, 5, 200])
    assert spans[0] == 1 and spans[1] <= 5 and spans[2] > 1, spans


def test_never_speculates_below_plain_by_the_margin():
    """One request, acceptance a at every position: spec's predicted rate over plain's is E(S) P / (D + V).
    Better than plain but by less than SPEC_MARGIN, it decodes; clearly better, it drafts (no exploration:
    nothing has run yet)."""
    for a, want_spec in ((0.25, False), (0.35, True)):
        pol = _policy(plain_ms=1.0, verify_ms=1.0, draft_ms=0.3)
        pol.estimates.population[:] = [[a * 1e6] * (B - 1), [1e6] * (B - 1)]  # a well-measured population
        ids = _admit(pol, 1)
        table = pol.estimates.tables(ids)
        ratio = table[0].max() * 1.0 / 1.3  # best E over the spec step's cost, against plain's 1 token a ms
        spans = pol.choose(ids, [200])
        assert (max(spans) > 1) == want_spec, (a, ratio, spans)
        assert (ratio > 1 + SPEC_MARGIN) == want_spec and ratio > 1, (a, ratio)


def test_exploration_stays_within_its_budget():
    """A stream of requests whose drafts are never accepted, each new one poorly known: exploration drafts
    some of them, and the predicted regret never exceeds EXPLORE_BUDGET of the time observed."""
    pol = _policy(plain_ms=1.0, verify_ms=1.2, draft_ms=0.3)
    rng = random.Random(0)
    live: list[int] = []
    next_id = 0
    for _ in range(3000):
        while len(live) < 8:
            pol.admit(next_id, 64)
            live.append(next_id)
            next_id += 1
        spans = pol.choose(live, [64] * len(live))
        cost = 1.0e-3 if max(spans) == 1 else 1.5e-3
        pol.observe(StepReport(tuple(live), tuple(spans), (0,) * len(live), cost, 0.3e-3 if max(spans) > 1 else None))
        assert pol.regret_s <= EXPLORE_BUDGET * pol.elapsed_s + 1e-12, (pol.regret_s, pol.elapsed_s)
        if rng.random() < 0.1:  # a request finishes
            pol.release(live.pop(rng.randrange(len(live))))
    assert pol.counts["explored"] > 0, pol.stats()
    c = pol.counts
    assert c["plain"] + c["held"] > 0.9 * (c["plain"] + c["held"] + c["spec"]), pol.stats()


def test_exploration_finds_a_workload_that_turned_good():
    """The population's drafts were never accepted; the live requests now accept every draft. Exploration
    (optimism about poorly known requests) drafts them, and once measured they draft every step."""
    pol = _policy(plain_ms=1.0, verify_ms=1.2, draft_ms=0.3)
    pol.estimates.population[:] = [[0.0] * (B - 1), [400.0] * (B - 1)]
    ids = _admit(pol, 4)
    pol.elapsed_s = 1.0  # time run before: an exploration budget of EXPLORE_BUDGET seconds
    drafted_at = None
    for step in range(200):
        spans = pol.choose(ids, [10_000] * 4)
        accepted = tuple(s - 1 for s in spans)
        pol.observe(StepReport(tuple(ids), tuple(spans), accepted, 1.5e-3 if max(spans) > 1 else 1e-3, 0.3e-3))
        if max(spans) > 1 and drafted_at is None:
            drafted_at = step
    assert drafted_at is not None, pol.stats()
    assert pol.choose(ids, [10_000] * 4) == [B] * 4, pol.stats()


def _with_tables(pol: GoodputSpans, slow_e: float) -> None:
    """Acceptance given as E tables: request 0 commits `slow_e` tokens at any span > 1, the others every draft."""
    fast = np.arange(1, B + 1, dtype=float)
    slow = np.concatenate([[1.0], np.full(B - 1, slow_e)])
    pol.estimates.tables = lambda ids, z=0.0: np.stack([slow if r == 0 else fast for r in ids])  # type: ignore


def test_closed_batch_waits_for_its_slowest_request():
    """Seven requests accept every draft, one almost none; a draft step costs 1.4 plain steps. Open (requests
    join as others finish), drafting the seven wins tokens a second. Closed (a wave: nobody joins), the batch
    drains when its slowest request does, which drafting cannot speed up enough: plain."""
    for joined, want in ((True, "the fast ones draft"), (False, "plain")):
        pol = _policy(plain_ms=1.0, verify_ms=1.1, draft_ms=0.3)
        ids = _admit(pol, 8)
        _with_tables(pol, slow_e=1.2)
        if joined:
            pol.choose(ids, [200] * 8)
            pol.admit(99, 200)
            pol.release(99)
        assert pol.open == joined
        spans = pol.choose(ids, [200] * 8)
        got = "plain" if max(spans) == 1 else "the fast ones draft" if min(spans[1:]) > 1 else spans
        assert got == want, (joined, spans)


def test_closed_batch_drafts_when_its_slowest_request_gains():
    pol = _policy(plain_ms=1.0, verify_ms=1.1, draft_ms=0.3)
    ids = _admit(pol, 8)
    _with_tables(pol, slow_e=2.0)  # the slowest commits 2 tokens a step: the wave drains 2 / 1.4 times faster
    assert min(pol.choose(ids, [200] * 8)) > 1


def test_an_untimed_kind_of_step_is_run_to_time_it():
    pol = GoodputSpans(B)  # no costs at all
    ids = _admit(pol, 2)
    assert pol.choose(ids, [100, 100]) == [B, B]  # a speculating step first
    pol.observe(StepReport(tuple(ids), (B, B), (3, 3), 2e-3, 0.5e-3))
    assert pol.choose(ids, [100, 100]) == [1, 1]  # then a plain one
    pol.observe(StepReport(tuple(ids), (1, 1), (0, 0), 1e-3, None))
    assert pol.counts["timing"] == 2
    pol.choose(ids, [100, 100])
    assert pol.counts["timing"] == 2, "both kinds are timed: the choice is the search's"


def test_step_costs_seed_measure_and_fit():
    costs = StepCosts()
    costs.seed("verify", 8, 4, 1.0)
    costs.observe("verify", 8, 4, 2.0)
    assert costs.get("verify", 8, 4) == 2.0, "the first measurement replaces the seed"
    costs.observe("verify", 8, 4, 3.0)
    assert costs.get("verify", 8, 4) == pytest.approx(2.2), "later ones move it by COST_EMA"
    costs.seed("verify", 8, 4, 9.0)
    assert costs.get("verify", 8, 4) == pytest.approx(2.2), "a seed never overwrites a measurement"
    costs.observe("verify", 16, 4, 4.2)  # two shapes: a line through rows 32 and 64
    assert costs.get("verify", 4, 4) == pytest.approx(2.2 - 2.0 / 32 * 16)
    assert costs.get("draft", 1, 16) is None
    costs.seed("draft", 1, 4, 0.5)
    costs.seed("draft", 2, 4, 0.6)
    costs.observe("draft", 1, 4, 0.8)  # measured 0.3 s over its replay: the host's share of a draft step
    assert costs.get("draft", 2, 4) == pytest.approx(0.9), "an unmeasured seed is priced with the host's share"


def _graph_shapes_policy() -> GoodputSpans:
    """A policy seeded as the runner seeds it on a GPU: every graph shape's timed replay (ms: plain 8,
    verify 8 + 0.04 x rows, draft 1.5 + 0.01 x rows)."""
    buckets, caps = (1, 2, 4, 8, 16, 32), (2, 4, 8, 16)
    pol = GoodputSpans(B)
    seeds = [ShapeCost("decode", b, 1, 8e-3) for b in buckets]
    seeds += [ShapeCost("verify", b, c, (8.0 + 0.04 * b * c) * 1e-3) for b in buckets for c in caps]
    seeds += [ShapeCost("draft", b, c, (1.5 + 0.01 * b * c) * 1e-3) for b in buckets for c in caps]
    pol.start(StepShapes(buckets, buckets, caps, caps), seeds)
    return pol


@pytest.mark.parametrize("spike", [1.0, 10.0, 30.0])
def test_one_slow_step_does_not_hide_speculation(spike):
    """16 requests accepting 6 drafts a block, where drafting pays 2.5x; the first speculating step is
    `spike` times slower than the rest (a first call, a collection). Exploration prices steps at their
    replays' floor, so the spike is re-measured away: after 300 steps every step drafts."""
    pol, ids = _graph_shapes_policy(), list(range(16))
    for rid in ids:
        pol.admit(rid, 100_000)
    first, spans_log = True, []
    for _ in range(400):
        spans = pol.choose(ids, [10_000] * 16)
        if max(spans) > 1:
            draft = (1.8 + 0.01 * sum(s > 1 for s in spans) * max(spans)) * 1e-3
            secs = (draft + (9.2 + 0.04 * sum(spans)) * 1e-3) * (spike if first else 1.0)
            first = False
            pol.observe(StepReport(tuple(ids), tuple(spans), tuple(min(s - 1, 6) for s in spans), secs, draft))
        else:
            pol.observe(StepReport(tuple(ids), tuple(spans), (0,) * 16, 8.3e-3, None))
        spans_log.append(max(spans))
    plain_late = sum(s == 1 for s in spans_log[300:])
    first_plain = spans_log.index(1) if 1 in spans_log else None
    assert plain_late == 0, f"spike {spike}: {plain_late} of the last 100 steps plain (first plain at {first_plain})"


def test_acceptance_estimates_shrink_toward_the_population():
    est = AcceptanceEstimates(B)
    for rid in range(50):  # the population accepts position 1 half the time, never position 2
        est.add(rid)
        est.observe([rid], [B], [rid % 2])
        est.remove(rid)
    est.add(100)
    new = est.tables([100])[0]
    assert new[1] == pytest.approx(1 + est.rates()[0]), "a new request starts at the population's rate"
    for _ in range(30):
        est.advance()
        est.observe([100], [B], [B - 1])
    own = est.tables([100])[0]
    assert own[B - 1] > 0.8 * B, f"a measured request moves to its own acceptance: {own}"
    optimistic = est.tables([100], z=1.0)[0]
    assert np.all(optimistic >= own - 1e-12)
    assert own[1] < 2.0 - 1.0 / (30 + PRIOR_WEIGHT), f"its own evidence is still shrunk toward the population: {own}"


def test_a_plain_decision_is_searched_again_after_doubling_intervals():
    """A decision the search repeats is held: searched again after 1, 2, 4, ... HOLD_MAX steps, for any batch of
    its size when it is uniform (all plain here); a batch of another size is searched at once."""
    from refengine.span_policy.goodput import HOLD_MAX

    pol = _policy()
    ids = _admit(pol, 4)
    _feed(pol, ids, lambda r: 0)
    searched = []
    for step in range(60):
        before = pol.counts["plain"]
        assert pol.choose(ids, [200] * 4) == [1] * 4
        if pol.counts["plain"] > before:
            searched.append(step)
    gaps = [b - a for a, b in zip(searched, searched[1:])]
    assert gaps[:5] == [1, 2, 4, 8, 16] and set(gaps[4:]) == {HOLD_MAX}, searched
    before = pol.counts["plain"]
    pol.choose(ids[:3], [200] * 3)
    assert pol.counts["plain"] == before + 1, "a batch of another size is searched"


def test_exploration_is_charged_what_its_steps_really_cost():
    """A host-bound pair (the tiny models on a GPU): every step takes ten times its graphs' replays, and no draft
    is ever accepted (tau 1). Exploration searches at the replays' floor but is charged what the step costs, and
    an explored choice is not held for free: the time speculation really loses stays within EXPLORE_BUDGET of
    the time run (plus the steps that time an unpriced kind), and most request-steps decode plainly."""
    buckets, caps = (1, 2, 4, 8, 16), (2, 4, 8, 16)
    pol = GoodputSpans(B)
    seeds = [ShapeCost("decode", b, 1, 0.1e-3) for b in buckets]
    seeds += [ShapeCost("verify", b, c, 0.12e-3) for b in buckets for c in caps]
    seeds += [ShapeCost("draft", b, c, 0.05e-3) for b in buckets for c in caps]
    pol.start(StepShapes(buckets, buckets, caps, caps), seeds)
    ids = _admit(pol, 16)
    plain_s, spec_s, draft_s = 1.0e-3, 1.7e-3, 0.5e-3  # ten times: decode 0.1, verify 0.12 + draft 0.05 ms
    lost = elapsed = 0.0
    spans_by_width: dict[int, int] = {}
    for _ in range(600):
        spans = pol.choose(ids, [10_000] * 16)
        spec = max(spans) > 1
        secs = spec_s if spec else plain_s
        pol.observe(StepReport(tuple(ids), tuple(spans), (0,) * 16, secs, draft_s if spec else None))
        lost, elapsed = lost + (secs - plain_s), elapsed + secs
        for s in spans:
            spans_by_width[s] = spans_by_width.get(s, 0) + 1
    allowed = EXPLORE_BUDGET * elapsed + pol.counts["timing"] * (spec_s - plain_s)
    assert lost <= allowed, (
        f"speculation lost {lost * 1e3:.1f} ms of {elapsed * 1e3:.1f} (allowed {allowed * 1e3:.1f}): {pol.stats()}"
    )
    drafted = sum(v for k, v in spans_by_width.items() if k > 1)
    assert spans_by_width.get(1, 0) > 10 * drafted, (spans_by_width, pol.stats())
