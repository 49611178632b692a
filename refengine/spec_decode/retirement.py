"""Adaptive speculation's retirements (a mixin of AdaptivePolicy, refengine/spec_decode/adaptive.py): when a
request stops speculating for good, in which regimes, and what counts as a surprising block.

The regimes: position 1 failing in first and later blocks alike (on ample evidence), or a plain regime at this
batch size: no decision to speculate and no surprising block for RETIRE_AFTER decisions, position 1 not known
to fail in first blocks, later blocks tested on some evidence, and a uniform batch of the later blocks'
population losing to plain (span_choice.plain_wins_uniformly). Why each condition (simulation, tests/unit/
test_adaptive.py's `_simulate_phases`): without the RETIRE_AFTER count, geometric 0.6 at c32 (the span choice
mixing speculating and plain steps) retired requests with unlucky blocks, which then rode in speculating steps
and made their waves' tails long (0.990 -> 0.942 of the better mode); while position 1 is known to fail in
first blocks, the first probe of a workload turning good retired its request while the rest of its wave sped
up; without the population's test, requests with poor blocks of their own retired while the later blocks
would win. Which requests, and the probe sample that goes with it: refengine/spec_decode/probe_sample.py.
In a batch of PROBE_SAMPLE or more (nineteenth session, docs/PERF.md runs 88-94): with no position known to
fail, a block is a surprise only past a count its kind of block rarely reaches (_surprising); where a probe step
is dear, only once its step has as many such blocks as that many drafting blocks rarely give (rare_blocks.py);
and in a plain regime a request that drafted retires whatever its own table and pending follow-up probes
(_retire).
"""

from __future__ import annotations

from refengine.spec_decode.acceptance_estimate import SHORT_PROBE_EVIDENCE, SHORT_PROBE_RATE, table_from_rates
from refengine.spec_decode.dormancy import DORMANT_PRICE
from refengine.spec_decode.exploration import THIN_EVIDENCE
from refengine.spec_decode.probe_sample import PROBE_SAMPLE
from refengine.spec_decode.rare_blocks import SURPRISE_ODDS, RareBlocks
from refengine.spec_decode.span_choice import Decision, Table, plain_wins_uniformly, uniform_spec_costs
from refengine.spec_decode.wave_guard import WaveGuard

RETIRE_AFTER = 128  # decisions in a row to decode plainly before a request retires on its blocks' own evidence


class Retirement(RareBlocks):
    """Overrides Exploration's _plain_regime and _surprise (the probe sample and probing read them)."""

    # what AdaptivePolicy provides, besides Exploration's and RareBlocks'
    last: Decision | None
    _tables: tuple[tuple, list[Table]] | None
    _spec_at: int
    _regime_at: tuple[tuple, tuple[float, list[float]] | None]
    _admit_at: tuple[tuple, list]
    _retiring: int | None
    guard: WaveGuard

    def _retire(self, req_ids: list[int], spans: list[int]) -> None:
        """Retire the requests the decision leaves at span 1 whose evidence is settled (probe_sample.py says
        which, and why), while position 1 fails in first and later blocks alike or in a plain regime
        (_plain_regime): a request that drafted, its blocks in line with the workload (not probing), whose own
        uniform batch would lose to plain too (plain_wins_uniformly; while position 1 fails it does); a request
        passed over by the probe sample, on fresh evidence (and in a plain regime, its table losing too).
        In a plain regime in a batch of PROBE_SAMPLE or more, a request that drafted retires whatever its own
        table, and also while follow-up probes would still be due (_probing: at c32 the budget seldom affords
        one, and the request then waited for good): the regime means no decision for RETIRE_AFTER decisions
        found a step where it, or anyone, drafting wins, and a batch with one request still capturing runs the
        decode graph with taps for all. With either test the trained tiny pair at c32 on the H200 kept 10-12
        probed requests of 198 from retiring, and 121-124 of a wave's 127 steps wrote taps (runs 92, 93)."""
        d, out = self.last, self.sample
        if d is None or self._tables is None:
            return
        fails = self._position_one_fails()
        costs = self._plain_regime(len(req_ids), fails)
        self._retiring = len(req_ids) if costs is not None else None  # (its probes' blocks: dormancy's calm)
        if costs is None:
            return
        n, tables = len(req_ids), self._tables[1]
        # a large batch in a plain regime: a request that drafted retires whatever its own table and probes, as
        # no decision in RETIRE_AFTER found a step where it drafts worth it (see the docstring)
        large = n >= PROBE_SAMPLE and not fails
        for i, (r, s) in enumerate(zip(req_ids, spans)):
            if s != 1 or r in out.retired or d.spans[i] != 1 or r in self.in_flight:
                continue  # drafting now (or its shadow probe is), retired already, or a plain exploration
            if r in self.drafted:
                if not large and (self._probing(r) or not plain_wins_uniformly(tables[i], n, *costs)):
                    continue
                if not fails and self._awaits_reprobe(r, n):
                    continue
            elif not (out.settled(r) and (fails or plain_wins_uniformly(tables[i], n, *costs))):
                continue
            regime = "position 1 fails" if fails else "plain regime"
            out.retire(r, f"{regime} / {'own blocks' if r in self.drafted else 'passed over'} / batch {n}")
            self._version += 1  # its table is now flat: the cached decision and tables are stale

    def admit(self, req_id: int, max_tokens: int, prompt_rows: int, batch: int, arriving: int = 1) -> bool:
        """A new request joining a batch of `batch` requests (itself included), with `arriving` - 1 others in the
        same prefill, before it: True when it is admitted retired (refengine/spec_decode/dormancy.py: the policy
        is dormant, the regime holds at this batch size, staying awake is not cheap there (_awake_is_cheap),
        and the work admitted since the last probe does not pay for one), so its prefill captures
        nothing and it never drafts; False: it is a new request like any other (a dormant one's probe: not
        passed over by the sample). `prompt_rows`: its prompt's context, which its probe would catch up."""
        self.budgets[req_id] = max_tokens  # (_rare_together prices a probe against its batch's whole work)
        # a prefill's requests see one state (no step, observation or cost sample between them): its tests and
        # its probe's price once a prefill, where per request they were ~60% of a dormant c32 prefill's admission
        key = (self.steps, self._version, self.elapsed_s, batch)  # (_version: every acceptance observed)
        unseen = lambda: self._plain_regime(batch, self._position_one_fails()) is None  # noqa: E731
        if self.guard.admit(req_id, max_tokens, batch, arriving, key, unseen):  # its size lost: wave_guard.py
            self.sample.retire(req_id, f"wave guard / batch {batch}", at_admission=True)
            return True
        if self._admit_at[0] != key:
            self._admit_at = (key, [self._position_one_fails(), None])
        memo, dormancy = self._admit_at[1], self.dormancy
        fails = memo[0]
        if not dormancy.dormant(batch, fails):
            return False
        if memo[1] is None:
            costs = self._plain_regime(batch, fails)
            memo[1] = (costs, self._probe_step_s(batch, costs[0], 0) if costs is not None else 0.0)
        costs, probe = memo[1]
        if costs is None:
            return False
        plain, probe = costs[0], probe + self.cost.catch_up_s(prompt_rows)  # (its own prompt's catch-up)
        kind = batch >= PROBE_SAMPLE
        if not dormancy.entered[kind]:
            if self._awake_is_cheap(probe, arriving * max_tokens * plain / batch, fails):
                return False
            dormancy.entered[kind] = True
        if not dormancy.admit(req_id, max_tokens * plain / batch, max(probe, 0.0)):
            return False
        self.sample.retire(req_id, f"dormant / batch {batch}", at_admission=True)
        return True

    def _awake_is_cheap(self, probe_s: float, arriving_s: float, fails: bool) -> bool:
        """Stay awake (no dormant admission) where nothing is known to fail, in first or later blocks, and a
        probe step costs under DORMANT_PRICE of the plain time of the work arriving with it (`arriving_s`: the
        requests admitted in the same prefill). There a surprise is only a block past the workload's odds
        (_surprising), and a dormant policy sees a turn only through the probes DORMANT_SHARE of its work pays
        for: in simulation (tests/unit/test_dormancy.py) a c8 / c32 wave workload turning from geometric 0.25 to
        0.85 ran 0.33-1.07 / 0.50-0.99 of the better mode after the turn dormant, 0.80-1.07 / 0.96-1.02 with this
        rule, at ~0.4% a wave (Qwen3-4B shapes; the trained tiny pair's probe step is 1.3-2.3% of its waves' work:
        dormant as before). Arrivals one at a time, or where a position is known to fail (a turn then surprises by
        the position rule), dormancy is unchanged. A failing position counts here on half the evidence
        failing_span asks, and the rule is asked until dormancy is entered, not after (until a surprise): with
        failing_span's test the bench's tau 1.3 profile woke its c32 cell for most waves (H200 run 142)."""
        if fails or self.estimates.fails_somewhere(SHORT_PROBE_EVIDENCE / 2):
            return False
        return probe_s < DORMANT_PRICE * arriving_s

    def _awaits_reprobe(self, req_id: int, n: int) -> bool:
        """In a batch small enough to re-probe (exploration.REPROBE_EVERY), a request retires in a plain regime
        only once a re-probe of its own, later in its generation, was in line too: retired on its first block
        alone, a generation turning good midway is never seen again (a retired request never drafts). The
        trained tiny pair at c1 on the H200 (run 79): every request retired after its first block, on a
        population whose later blocks came from the bench's settle (32-token runs, before the text loops), and
        adaptive ran 0.976 of plain where fixed DFlash ran 3.20x. Not while position 1 fails (nothing is
        accepted there, early or late), nor in larger batches (no re-probes there)."""
        return self._reprobing(n) and req_id not in self.reprobed

    def _plain_regime(self, n: int, fails: bool) -> tuple[float, list[float]] | None:
        """(P(n), uniform_spec_costs) while requests may retire at batch size n, else None: position 1 fails in
        first and later blocks alike (`fails`), or a plain regime: no decision to speculate and no surprising
        block for RETIRE_AFTER decisions, position 1 not known to fail in first blocks (while it is, only the
        position-1 rule, on ample evidence: a workload turning good is seen by its sample, and a probe failing
        in it must not retire), later blocks tested on some evidence (the trained tiny pair's first blocks fail
        and its later ones accept), and a uniform batch of the later blocks' population losing to plain (its
        speculating step priced with the host's time in large batches: CostModel.host_s, H200 run 152)."""
        key = (self.steps, self._version, n, fails)  # (a decision asks twice: its probe sample, its retirements)
        if self._regime_at[0] != key:
            self._regime_at = (key, self._find_plain_regime(n, fails))
        return self._regime_at[1]

    def _find_plain_regime(self, n: int, fails: bool) -> tuple[float, list[float]] | None:
        est = self.estimates
        if not fails and (self.steps - self._spec_at < RETIRE_AFTER or est.failing_span() <= 2):
            return None
        if est.later_tested[0] < THIN_EVIDENCE:
            return None
        # a large batch's regime prices a speculating step's host time too (CostModel.host_s: run 152); small
        # batches keep the runner's times (there a thinner margin held choices plain: twenty-fourth session)
        spec = uniform_spec_costs(n, self.block_size, self.cost, self.rows, regime=n >= PROBE_SAMPLE)
        costs = (self.cost.plain_step_s(n), spec)
        if not plain_wins_uniformly(table_from_rates(est.population_rates()), n, *costs):
            return None
        return costs

    def _position_one_fails(self) -> bool:
        """First blocks accept position 1 at under SHORT_PROBE_RATE on ample evidence, and later blocks too, on
        THIN_EVIDENCE tests of their own. Later blocks are drafted only by explorations once first blocks fail
        (a follow-up probe needs an accepted draft), so under steady arrivals at c8-c24 their decayed tests
        stalled at 11-14 of the 16 first blocks need, no regime began, no request retired and every decode
        step wrote taps: tau 1 ran 0.986 of plain at c16 in simulation (tests/unit/test_adaptive_steady.py).
        A drafter whose later blocks accept where its first ones fail (the trained tiny pair: position 1 at
        0.5-0.7 in later blocks) shows that on a handful of them."""
        est = self.estimates
        if est.failing_span() != 2 or est.later_tested[0] < THIN_EVIDENCE:
            return False
        return est.population_rates()[0] < SHORT_PROBE_RATE

    def _surprising(self, accepted: int, first: bool, by_kind: tuple[bool, bool] | None = None) -> bool:
        """A block (`first`: a request's first) accepting `accepted` drafts is a surprise (`by_kind`:
        _surprising_by_kind's verdicts on it, when the caller has them): no plain regime for
        RETIRE_AFTER decisions after it, and a passed-over request does not retire on it. It accepted _surprise()
        or more; in a batch of PROBE_SAMPLE or more while no position is known to fail (first or later blocks),
        as many drafts as blocks of its kind reach in under SURPRISE_ODDS of cases (unlikely_count).

        Why the odds there: with nothing known to fail, _surprise() is 1, and a drafter that accepts some of the
        time accepts something in every other block: the trained tiny pair at c8-c32 on the H200 never began a
        plain regime although plain won every decision there, and adaptive ran 0.87-0.90 of plain (run 88).
        Dropping surprises there instead lost turns (simulation: a c8 workload going from geometric 0.25 to 0.85
        ran 0.86 of the better mode after it, 1.05 with surprises). Small batches keep the rule: at c1 a lone
        request's block is all there is. Judged, as _surprise(), by what was known at the last decision."""
        if by_kind is None:
            by_kind = self._surprising_by_kind(accepted, first)
        return by_kind[self._surprise_at[3]]  # by the rule of the last decision's kind of batch

    def _surprising_by_kind(self, accepted: int, first: bool) -> tuple[bool, bool]:
        """Whether the block is a surprise by the rule of a batch smaller than PROBE_SAMPLE, and by that of a
        larger one (the odds, while nothing is known to fail). Dormancy keeps its calm by kind of batch and
        loses each by its own rule: a first block at c1 accepting position 1 (a surprise there while position 2
        is not yet known to fail) is an ordinary block at c8-c32, where the bench's tau 1.3 profile (position 1
        in 30% of blocks) had 18 calm first blocks reset by one such block at c1, and the c8 cell then probed
        every wave (simulation, docs/PERF.md twenty-first session). A block drafted in a small batch is judged by
        the small rule only: the large calm is not its to reset (Dormancy.surprise)."""
        least = self._surprise()
        _, _, rare, large_batch = self._surprise_at
        small = accepted >= least
        return small, small and large_batch and (rare is None or accepted >= rare[0 if first else 1])

    def _surprise(self) -> int:
        """Accepted drafts that make a block a surprise: the first position known to fail, else 1. As known at
        the last decision: a step's blocks are judged by what was known when they were drafted, and it is
        computed once a step (per observation it was 4.6x the cost of observing: 11 against 2.4 us, dev CPU).
        With it, once a step, the rare counts of first and later blocks large batches' rule reads where nothing is
        known to fail (else None), and whether the last choice's batch was a large one."""
        if self._surprise_at[0] != self.steps:
            est = self.estimates
            fails = min(est.failing_span(), est.failing_span(later=True))
            batch = len(self.last.spans) if self.last is not None else 0  # the last choice's requests
            rare = None
            if fails >= self.block_size:
                rare = (est.unlikely_count(True, SURPRISE_ODDS), est.unlikely_count(False, SURPRISE_ODDS))
            least = fails - 1 if fails < self.block_size else 1
            self._surprise_at = (self.steps, least, rare, batch >= PROBE_SAMPLE)
        return self._surprise_at[1]
