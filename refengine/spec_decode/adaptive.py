"""Adaptive speculation: per step, each speculating request's verify span (1 = plain decode for it), chosen
to maximise expected committed tokens per second. Pure Python (no torch): the scheduler feeds it measured
step costs and per-request acceptance, and asks it for spans.

Model (all online, with priors):
- acceptance (refengine/spec_decode/acceptance_estimate.py): per request and draft position, the chance a
  draft is accepted given the earlier ones were, from decayed counts shrunk toward the population's rate at
  that position (later blocks' and first blocks' apart, the later shrunk toward the first; a first block's
  toward the previous position's, the first toward the pooled rate). So a new request starts at what the
  workload's first blocks have been accepting (and its first-step probe adds its own), and E_i(S), the
  tokens a span S is expected to commit, follows whatever shape acceptance has along the block.
- cost (refengine/spec_decode/step_costs.py): V(N, R) for a verify of N requests computing R rows (R is what
  the runner computes, `executed_rows`: on the GPU the verify graph's shape, bucket x row cap; eager, the
  real rows), D(M) for a draft of M requests, P(N) for a step where every span is 1 (a plain decode step,
  the one-row decode graph with taps): a measured time per step shape (timed graph replays, then a moving
  average of the runner's GPU-synchronised times of steps that captured no graph), linear fits elsewhere.
- decision (refengine/spec_decode/span_choice.py): for each cap S in 2..B every request gets min(S,
  remaining_i); requests are then switched to span 1 lowest gain first, and the choice maximising
      sum_i E_i(s_i) / (D(#requests with s_i > 1) + V(N, R(sum_i s_i)))
  wins only if it beats plain decode's N / P(N) by SPEC_MARGIN: near break-even plain is kept (a wrong spec
  choice loses more than a wrong plain one). An O(N) upper bound skips the search when plain clearly wins,
  and a plain decision is reused until an observation arrives or the batch changes. A draft's
  catch-up of context carried past a plain stretch is not in D: it is learnt as C(rows), a fixed cost plus a
  cost per carried row, and charged to the explorations that would cause one (observe_step) and to every
  speculating candidate of a choice while one is due (Exploration._switch_s). A speculating step's next
  search is prepared while its graph runs (refengine/spec_decode/prepared_choice.py).
- exploration and probes (refengine/spec_decode/exploration.py): within a budget, the losing kind is tried
  now and then, and new requests draft a block on their first step; while position 1 fails or in a plain
  regime, a sample of them (otherwise, in a large batch decoding plainly, a lone one's probe waits up to
  PROBE_HOLD decisions to share its verify step), and requests retire from speculation
  (refengine/spec_decode/probe_sample.py); in small batches, requests decoding plainly draft a block again
  now and then (re-probes: a generation's acceptance can turn good midway); once speculation has settled
  into not paying, new requests are admitted retired, but for the probes the admitted work pays for
  (refengine/spec_decode/dormancy.py: admit).
- the wave guard (refengine/spec_decode/wave_guard.py): a closed batch (a wave) in which the search chose to
  speculate is judged at its end against plain decode by the same cost model; after losses in a row, closed
  batches of that size and larger are admitted retired for a while (the choice prices tokens a second, and a
  wave waits for its slowest request).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from refengine.spec_decode.acceptance_estimate import AcceptanceEstimates
from refengine.spec_decode.dormancy import Dormancy
from refengine.spec_decode.exploration import MIN_EXPLORE, REPROBE_EVERY
from refengine.spec_decode.policy_summary import policy_summary
from refengine.spec_decode.prepared_choice import PREPARED_MARGIN, Prepared, PreparedChoice
from refengine.spec_decode.probe_sample import ProbeSample
from refengine.spec_decode.retirement import RETIRE_AFTER, Retirement
from refengine.spec_decode.shadow_probe import ShadowChoice
from refengine.spec_decode.span_choice import Decision, RowsFn, Table, real_rows
from refengine.spec_decode.step_costs import CostModel
from refengine.spec_decode.wave_guard import WaveGuard, modelled_step_s, plain_modelled_s


@dataclass
class AdaptivePolicy(Retirement, ShadowChoice, PreparedChoice):
    """The scheduler's span chooser in `speculation="adaptive"` mode, with its visible statistics.
    `rows` maps (requests, real rows) to the rows a verify computes (the runner's graph shapes)."""

    block_size: int
    cost: CostModel = field(default_factory=CostModel)
    rows: RowsFn = real_rows
    estimates: AcceptanceEstimates = field(init=False, repr=False)  # per request and position
    drafted: dict[int, tuple[int, int]] = field(default_factory=dict)  # req -> (drafting steps, last accepted)
    _drafted_at: dict[int, int] = field(default_factory=dict)  # req -> the decision of its last draft
    _held_since: dict[int, int] = field(default_factory=dict)  # req -> the decision its held probe was due
    pending: Callable[[int], int] | None = None  # the proposer's rows a request carries (DFlashLane.pending_rows)
    catch_ups: int = 0  # catch-up flushes observed
    _catch_up_rows: int = 0  # pending rows the last choice's drafting requests carried past a plain stretch
    interval: int = MIN_EXPLORE
    steps: int = 0
    elapsed_s: float = 0.0  # measured time of the steps observed so far
    regret_s: float = 0.0  # predicted time exploration has cost so far (at most EXPLORE_BUDGET x elapsed_s)
    probes: int = 0  # new requests given a full block to measure their acceptance
    reprobes: int = 0  # of those probes, re-probes of requests decoding plainly (exploration.REPROBE_EVERY)
    reprobe_every: int = REPROBE_EVERY  # small batches' re-probe period, in decisions (0: no re-probes)
    reprobed: set[int] = field(default_factory=set)  # live requests re-probed at least once
    probed: list[int] = field(default_factory=list)  # the last choice's probes: indices widened past its spans
    in_flight: set[int] = field(default_factory=set)  # requests whose shadow probe awaits its answer
    shadows: int = 0  # probes drafted as shadows (refengine/spec_decode/shadow_probe.py)
    errors: int = 0  # choices that raised (those steps decoded plainly) and preparations that raised (Scheduler)
    probe_regret_s: float = 0.0  # predicted time the first-step probes cost (outside the exploration budget)
    sample: ProbeSample = field(default_factory=ProbeSample)  # the probe sample and retirements
    dormancy: Dormancy = field(default_factory=Dormancy)  # new requests admitted retired (dormancy.py)
    guard: WaveGuard = field(init=False, repr=False)  # closed batches judged against plain decode (wave_guard.py)
    _retiring: int | None = None  # the last full decision's batch, when in a retirement regime (dormancy's calm)
    _next_explore: int = MIN_EXPLORE
    explored: int = 0
    searched: int = 0  # decisions that ran the span search (the rest: the bound showed plain wins, or reused)
    prepared: int = 0  # decisions that took the search prepare() did while the step before ran
    prepared_margin: float = PREPARED_MARGIN  # the least predicted gain a prepared search is taken at
    caps: Counter = field(default_factory=Counter)  # winning S per decision (1 = plain)
    last: Decision | None = None
    _explored_kind: bool | None = None  # at the last exploration, was speculating the choice?
    last_mean_expected: float | None = None  # mean E_i(B) over the requests of the last full decision
    _decisions_before: int = 0
    _version: int = 0  # bumped by every acceptance observation (the cached plain decision is then stale)
    _cache_key: tuple | None = None
    # (steps, _surprise(), rare counts, whether the batch was large) as known at the last decision
    _surprise_at: tuple[int, int, tuple[int, int] | None, bool] = (-1, 1, None, False)
    _regime_at: tuple[tuple, tuple[float, list[float]] | None] = ((), None)  # (key, _plain_regime() then)
    _admit_at: tuple[tuple, list] = ((), [])  # (key, [fails, (regime, probe price) or None]): Retirement.admit
    # the last choice's step (its requests, budgets left, drafting blocks, whether its probe is dear: None until
    # priced) and its blocks observed past the rare count so far: RareBlocks._rare_together
    _judged: tuple[list[int], list[int], int, bool | None] = ([], [], 0, None)
    _rare_seen: int = 0
    rare_together: list[int] = field(default_factory=lambda: [0, 0])  # rare blocks judged together, surprising
    budgets: dict[int, int] = field(default_factory=dict)  # live req -> its max_tokens, as admitted (admit)
    _spec_at: int = 0  # the step of the last decision to speculate, or of the last surprising block
    _cached: Decision | None = None
    _tables: tuple[tuple, list[Table]] | None = None  # (version, request ids) -> their E tables (read only)
    _prepared: Prepared | None = None  # prepare()'s search, for the next choice (prepared_choice.py)
    _settled: bool = False  # the cached plain decision was returned as it is (see choose's fast path)
    _reused: bool = False  # the last choose took that fast path

    def __post_init__(self) -> None:
        self.estimates = AcceptanceEstimates(self.block_size)
        self.guard = WaveGuard(lambda n: self.cost.bucket(n))
        self.bind_shapes(self.rows, None)

    def bind_shapes(
        self,
        rows: RowsFn | None,
        buckets: tuple[Callable[[int], int], Callable[[int], int]] | None,
        draft_caps: Callable[[int], int | None] | None = None,
    ) -> None:
        """The runner's step shapes: `rows(n, real_rows)` computed by a verify, the batch buckets of a target
        step / a draft, and a draft's score cap by its largest span (the cost table's keys)."""
        self._executed: dict[int, tuple[int, ...]] = {}  # n -> executed rows by real rows (choose_spans)
        if rows is not None:
            self.rows = functools.lru_cache(maxsize=4096)(rows)  # a pure function of (n, rows): memoised
        if buckets is not None:  # pure functions of the request count: memoised (looked up every step)
            self.cost.bucket, self.cost.draft_bucket = (functools.lru_cache(maxsize=1024)(b) for b in buckets)
        if draft_caps is not None:
            self.cost.draft_cap = functools.lru_cache(maxsize=64)(draft_caps)

    def reset_stats(self) -> None:
        """Zero the decision counters (bench rows); the learnt costs and acceptance estimates stay."""
        self.explored, self.searched, self.probes, self.reprobes, self.caps = 0, 0, 0, 0, Counter()
        self.prepared = 0
        self.shadows = 0
        self.sample.unprobed = self.sample.retirements = 0
        self.dormancy.admitted = self.dormancy.probes = 0
        self.rare_together = [0, 0]
        self.dormancy.doubts = [0, 0]
        self.sample.retired_by = Counter()
        self._decisions_before = self.steps

    def expected(self, req_id: int) -> Table:
        """E(s) for s = 0..B: the tokens a span s is expected to commit for this request now."""
        return self.estimates.tables([req_id])[0]

    def choose(self, req_ids: list[int], remaining: list[int]) -> list[int]:
        """Each request's span this step (1: plain decode for it); notes what the drafting ones carry (the
        catch-up observe_step may see)."""
        self.probed = []
        spans = self._choose(req_ids, remaining)
        out = self.retired
        if out and max(spans) > 1 and any(r in out for r in req_ids):
            # a retired request never drafts (the scheduler freed its drafter context). Its flat table gains
            # nothing, but where its rows fall in the same graph shape and its count in the same draft bucket
            # it costs nothing either: an exact tie, which the search's first-of-maxima (and the loops before
            # it) settled by keeping it at the cap. The H200 engine then failed in _pending_rows (KeyError: a
            # released context) under steady arrivals at c32 (runs 109, 111)
            spans = [1 if r in out else s for r, s in zip(req_ids, spans)]
        if not self._reused:  # (a reused decision retires no one new)
            self._retire(req_ids, spans)
        self._catch_up_rows = self._pending_rows(req_ids, spans) if max(spans) > 1 else 0
        self._judge_together(req_ids, spans, remaining)
        if self.guard.tracking:  # (whether the search itself chose to speculate: looks alone are not judged)
            searched = self.last is not None and not self._reused and self.last.cap > 1
            step_s = modelled_step_s(self.cost, self.rows, spans, remaining, self._catch_up_rows)
            self.guard.step(req_ids, remaining, step_s, searched)
        return spans

    def _plain_modelled_s(self, n: int) -> float:
        return plain_modelled_s(self.cost, n)

    @property
    def retired(self) -> set[int]:
        """Live requests retired from speculation (refengine/spec_decode/probe_sample.py)."""
        return self.sample.retired

    @property
    def unprobed(self) -> int:
        return self.sample.unprobed

    @property
    def retirements(self) -> int:
        return self.sample.retirements

    def take_retired(self) -> list[int]:
        """Requests retired since the last call: the scheduler frees their drafter contexts; from now on they
        decode plainly (span 1 whatever the batch) and their rows are not captured."""
        return self.sample.take_retired()

    def reuse_plain(self, min_remaining: int) -> bool:
        """choose's O(1) path for the caller that knows the requests are those of the last choice, and that
        each committed exactly one token since (a plain stretch, refengine/scheduler.py): True, counting the
        step as choose would, when its plain decision holds (nothing learnt, no exploration due: _holds);
        False: call choose."""
        key = self._cache_key
        if key is None or not self._reuse((self._version, key[1], self._budget_key(min_remaining))):
            return False
        if self.guard.tracking:
            self.guard.reuse(self._plain_modelled_s(len(key[1])))
        return True

    def _budget_key(self, min_remaining: int) -> int:
        return min(min_remaining, self.block_size)

    def _holds(self, key: tuple) -> bool:
        """The cached plain decision answers the choice for `key` (version, request ids, smallest budget up to a
        block) without a search: nothing learnt and the same requests, so every one of them decoded plainly
        since (one token each) and their budgets shrank evenly. Under a block the search would see shorter
        spans, but a plain decision stays plain there: at equal budgets exactly (each candidate then was one
        before), at unequal ones in all but 5 of 35143 random cases, none of them predicted more than 0.4% past
        SPEC_MARGIN (tests/unit/test_plain_stretch.py). Searched, the last B - 1 steps of a stretch each ran
        the search (~0.2 ms at c16 on the dev CPU): 15 of every 128 steps of the trained tiny pair's bench
        rounds, whose probes leave the budgets unequal."""
        cached = self._cache_key
        return cached is not None and cached[:2] == key[:2] and key[2] <= cached[2]

    def _reuse(self, key: tuple) -> bool:
        """The cached plain decision holds for `key` (_holds) and it probed or explored nothing: no request
        became new or probe-worthy since (remaining budgets only shrink), so plain again, at O(1), counted as
        a decision."""
        if not (self._settled and self.steps + 1 < self._next_explore and self._holds(key)):
            return False
        if self.steps + 1 == self._spec_at + RETIRE_AFTER:
            return False  # a plain regime begins: the full choice looks for requests to retire
        if self._reprobes_due(len(key[1]), self.steps + 1):
            return False  # the full choice re-probes (exploration.py)
        if self._held_probe_due(self.steps + 1):
            return False  # a held first-step probe is due (exploration.PROBE_HOLD)
        self._cache_key = key  # (the budgets shrink from here)
        self.steps += 1
        self.caps[1] += 1
        return True

    def _choose(self, req_ids: list[int], remaining: list[int]) -> list[int]:
        key = (self._version, tuple(req_ids), self._budget_key(min(remaining)))
        if self._reuse(key):
            self._reused = True
            return [1] * len(req_ids)
        self._settled = self._reused = False
        ready = self._take_prepared(key[1])  # the search prepared while the last step ran (prepared_choice.py)
        tables, early = ready if ready is not None else (self._tables_of(key[:2], req_ids), None)
        d = self._cached if self._cached is not None and self._holds(key) else None
        reused = d is not None  # nothing learnt and no request changed since a plain decision: it still holds
        if d is None:
            d = early or self._span_search(req_ids, remaining, tables)
            self._cache_key, self._cached = key, (d if d.cap == 1 else None)
        self.last_mean_expected = sum(e[-1] for e in tables) / len(tables)
        self.steps += 1
        self.last = d
        if d.cap > 1:
            self._spec_at = self.steps
        b, n, spec = self.block_size, len(req_ids), d.cap > 1
        if (self.cost.plain.updates if spec else self.cost.verify.updates) == 0 and max(remaining) > 1:
            self.explored += 1  # calibration: the other kind's curve has never been measured
            return [1] * n if spec else [max(1, min(b, r)) for r in remaining]
        spans = self._explore_or_probe(req_ids, remaining, tables, d)
        if spans is not None:
            return spans
        self.caps[d.cap] += 1
        self.searched += d.searched and not reused
        self._settled = d.cap == 1  # plain, nothing to probe or explore: the next step may reuse it at O(1)
        return d.spans

    @property
    def carried_rows(self) -> int:
        """Context rows the last choice's drafting requests carried past a plain stretch (0: no catch-up)."""
        return self._catch_up_rows

    def observe_step(
        self,
        n: int,
        rows: int,
        drafted: int,
        draft_s: float,
        verify_s: float,
        catch_up_s: float = 0.0,
        carried_rows: int | None = None,
        steps: int = 1,
        widest: int = 0,
    ) -> None:
        """A verify step of n requests and `rows` real rows (`drafted` of them drafting) and its timings;
        `carried_rows`: its choice's `carried_rows` (default: the last choice's; the scheduler passes the
        step's own, as it feeds a sample after the next choice); `steps`: how many such steps the sample's
        times are the mean of (a plain stretch's); `widest`: its largest span (the draft graph's score cap);
        `catch_up_s`: the part of the draft that projected context carried past a plain stretch (or a prompt),
        learnt as C(rows) (charged to the explorations that would cause one) and kept out of the draft curve: a
        switch's cost, not a steady draft's. Left in the draft curve, the trained tiny pair's drafts looked 4x
        dearer on the H200 (2.0 vs 0.5 ms) and adaptive never drafted; left out of everything, exploration
        after plain stretches was underpriced (with that, Qwen3-4B tau 1 c32 measured 0.73 of plain in one H200
        run, against 0.97 in the run before; docs/PERF.md)."""
        carried = self._catch_up_rows if carried_rows is None else carried_rows
        if catch_up_s > 0 and carried:
            self.cost.observe_catch_up(carried, catch_up_s)
            self.catch_ups += 1
        executed = rows if not drafted and rows == n else self.rows(n, rows)
        self.cost.observe(n, executed, drafted, max(draft_s - catch_up_s, 0.0), verify_s, widest)
        self.elapsed_s += (draft_s + verify_s) * steps

    def observe_acceptance(self, req_id: int, span: int, accepted: int) -> None:
        if span <= 1:
            return  # no drafts: nothing learnt about acceptance
        # its first block: its first draft, unless it was passed over by the probe sample and decoded plainly
        # before (then a later block, as an exploration's of a probed request is)
        first = req_id not in self.drafted and not self.sample.passed(req_id)
        # (small batches' rule, large ones': a large batch's rare blocks judged together): dormancy's calm
        doubts = self.dormancy.doubts[0]
        by_kind = self._rare_together(self._surprising_by_kind(accepted, first))
        surprising = self._surprising(accepted, first, by_kind)  # past what the workload accepts: no plain regime
        if first:
            self.sample.observe_first_block(surprising)
            # (a block that opened a doubt is not calm either)
            calm_of = (by_kind[0], by_kind[1] or self.dormancy.doubts[0] > doubts)
            self.dormancy.observe_first_block(req_id, calm_of, self._retiring)
        if surprising:
            self._spec_at = self.steps
        self.dormancy.surprise(*by_kind)
        self.estimates.observe(req_id, span, accepted, first)
        self._version += 1
        self.drafted[req_id] = (self.drafted.get(req_id, (0, 0))[0] + 1, accepted)
        self._held_since.pop(req_id, None)  # it drafted: no first-step probe waits for it (a speculating choice's)
        self._drafted_at[req_id] = self.steps

    def release(self, req_id: int, generated: int | None = None) -> None:
        """A request left (finished, aborted, or its prefill rolled back); `generated`: the tokens it ended
        with (None: its budget), for the wave guard's account of its batch."""
        self.in_flight.discard(req_id)
        self.budgets.pop(req_id, None)
        self.guard.release(req_id, generated, len(self.budgets), self._plain_modelled_s)
        self.estimates.release(req_id)
        self.drafted.pop(req_id, None)
        self._drafted_at.pop(req_id, None)
        self._held_since.pop(req_id, None)
        self.reprobed.discard(req_id)
        self.sample.release(req_id)
        self.dormancy.release(req_id)

    def summary(self) -> dict:
        """The policy's inputs and decisions, for stats / bench JSON (times in ms; policy_summary.py)."""
        return policy_summary(self)
