"""Adaptive speculation's exploration and probes (a mixin of AdaptivePolicy, refengine/spec_decode/adaptive.py):
when a step tries the losing kind, and which requests draft a block to measure their acceptance.

Exploration, within a budget: its predicted regret (an exploring step's time minus the time the chosen
spans need for the same expected tokens) may total at most EXPLORE_BUDGET of the measured step time so
far plus the live requests' remaining work at plain speed. Each curve is measured once at start-up
(calibration); then the losing kind (plain vs. speculating at full span) is tried every `interval` steps,
the interval doubling (MIN_EXPLORE .. MAX_EXPLORE) while the choice holds and dropping back when it
flips; and requests the choice leaves at span 1 are probed with a full block while they are new (up to
PROBE_STEPS drafting steps, as long as each accepts something), as many as the budget affords. The first
of those probes is not budgeted (its regret is counted apart, `probe_regret_s`, and never spends the
budget: charged to it, a few hundred new requests left the budget negative for good, and a workload whose
first blocks accept poorly stayed plain while fixed spans ran 3.4x faster; tests/unit/test_adaptive.py):
every request drafts a full block on its first step (also when the choice gives it a shorter span: a
short span tests only the first positions), so the population's rates follow the requests now running,
at every position. While the population's evidence is thin (position 1 tested fewer than THIN_EVIDENCE
times, decayed), a first-step probe that accepted nothing is repeated once, unbudgeted too: the trained tiny
pair's first block after the prompt accepts nothing and its later ones mostly all 15, so in a fresh process
one probe settled c1 at plain while fixed DFlash ran 3.6x faster (H200, run 43); in simulation that case
went from 0.48 to 1.0 of the better mode. It costs at most a few extra probes until the population has
seen THIN_EVIDENCE first blocks (one wave at c8 or more). While the first blocks accept position 1 at under
SHORT_PROBE_RATE on SHORT_PROBE_EVIDENCE tests (decayed), a first-step probe is a span-2 block: a verify
that accepts nothing tests only position 1, whatever its span, so it loses information only when position 1
accepts (and then the request is probed on as above). At c32 on Qwen3-4B shapes that verify computes 64
rows instead of 512 (H200: 4.7 against 9.9 ms; a plain step 5.1). More generally a probe or an
exploration drafts up to the first position known to fail (AcceptanceEstimates.failing_span). Under that
same condition, or in a plain regime (refengine/spec_decode/retirement.py), only a sample of new requests is probed
(in a batch of PROBE_SAMPLE or more), and once later blocks fail position 1 too, or in a plain regime,
requests retire from speculation (refengine/spec_decode/probe_sample.py: PROBE_SAMPLE, retirement). So where
plain wins, adaptive loses a speculative step per PROBE_SAMPLE requests (per request in small batches, or
while evidence is thin) plus about EXPLORE_BUDGET to plain decode (and the error of its predictions).

Held probes: in a batch of PROBE_SAMPLE or more whose choice is plain, where the sample does not apply, fewer
than PROBE_SAMPLE new requests' first-step probes wait up to PROBE_HOLD decisions for others, so that one
verify step carries several (they decode plainly meanwhile, capturing their features). In waves the new
requests arrive together and nothing changes; under steady arrivals (`refengine bench --arrivals steady`)
they come one at a time, and each probe was a verify step of its own (~2x a plain step): at c32 with the
published sharegpt profile, where the choice is mostly plain, 320 of 1964 decisions were such steps and
adaptive ran 0.921 of plain over three random paths in simulation; holding, 0.942 (geometric 0.6: 0.885 ->
0.910; tau 1, 1.3, 3, 6.5 and waves unchanged; tests/unit/test_adaptive_steady.py). On the H200 with it
(run 108, steady sharegpt): 1.268 of plain at c16, 1.005 at c32.

Re-probes, in a batch of fewer than PROBE_SAMPLE requests: every REPROBE_EVERY decisions, each request that
decodes plainly, has drafted before, is not retired, has more than a block left and last drafted at least
REPROBE_EVERY / 2 decisions ago drafts a block (up to the first position known to fail in later blocks),
unbudgeted like a first-step probe. A request's acceptance can turn good midway: the trained tiny pair's
text falls into loops after 10-40 poor blocks, and then its blocks accept all 15 drafts; judged by its first
blocks it decoded plainly to the end (dev CPU, c1: adaptive 128 tok/s, plain 136, fixed DFlash 486; with
re-probes adaptive 462). In simulation (tests/unit/test_adaptive_reprobe.py) such a turn went from 0.69 to
0.96 of the better mode at c1; stationary poor workloads at c1 lost 0.1-0.2% (requests not yet retired
re-probe). Not in larger batches: there, turns from acceptance 0 to 0.6-0.85 ran 2-15% slower with them.
In small batches a request retires in a plain regime only once a re-probe of its own was in line too
(Retirement._awaits_reprobe): a retired request never drafts again.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

from refengine.spec_decode.acceptance_estimate import AcceptanceEstimates
from refengine.spec_decode.dormancy import Dormancy
from refengine.spec_decode.probe_sample import PROBE_SAMPLE, ProbeSample
from refengine.spec_decode.span_choice import Decision, RowsFn, Table
from refengine.spec_decode.step_costs import CostModel

PROBE_STEPS = 3  # drafting steps a request is probed for while it keeps accepting (see _probing)
EXPLORE_BUDGET = 0.005  # exploration may cost at most this share of the measured step time (predicted regret)
MIN_EXPLORE, MAX_EXPLORE = 16, 256
REPROBE_EVERY = 64  # small batches: every this many decisions, requests decoding plainly draft a block again
PROBE_HOLD = 16  # decisions a lone new request's first-step probe may wait for others (large batches, plain)
THIN_EVIDENCE = 8.0  # while first blocks have tested position 1 fewer times (decayed), a first-step probe that
# accepted nothing is repeated once, unbudgeted like it (see the module docstring)


class Exploration:
    # what AdaptivePolicy provides
    block_size: int
    cost: CostModel
    rows: RowsFn
    estimates: AcceptanceEstimates
    drafted: dict[int, tuple[int, int]]
    sample: ProbeSample
    dormancy: Dormancy
    steps: int
    elapsed_s: float
    regret_s: float
    probes: int
    reprobes: int
    reprobe_every: int
    reprobed: set[int]
    probed: list[int]
    in_flight: set[int]
    probe_regret_s: float
    interval: int
    explored: int
    caps: Counter
    _next_explore: int
    _explored_kind: bool | None
    _version: int
    _drafted_at: dict[int, int]
    _held_since: dict[int, int]
    pending: Callable[[int], int] | None

    def _plain_regime(self, n: int, fails: bool) -> tuple[float, list[float]] | None:
        raise NotImplementedError

    def _surprise(self) -> int:
        raise NotImplementedError

    def _explore_or_probe(
        self, req_ids: list[int], remaining: list[int], tables: list[Table], d: Decision
    ) -> list[int] | None:
        """This step's spans when it explores or probes (decision `d` on these `tables`), else None."""
        b, n, spec = self.block_size, len(req_ids), d.cap > 1
        budget = None
        probe = self.estimates.failing_span()  # a first-step probe's span: up to the first position known to fail
        short = probe == 2  # position 1 fails in first blocks: short probes
        if self.steps >= self._next_explore:  # try the other kind: full spans vs plain
            span = self.estimates.failing_span(later=True)  # (as a probe's, in later blocks)
            out = self.sample.retired  # (retired requests draft in no exploration)
            trial = [1] * n if spec else [1 if r in out else max(1, min(span, k)) for r, k in zip(req_ids, remaining)]
            budget = self._budget(remaining)
            regret = self._regret(trial, tables, d, req_ids)
            if regret > budget:
                self._next_explore = self.steps + MIN_EXPLORE  # not affordable yet: look again later
            else:
                self.regret_s += regret
                same = self._explored_kind == spec
                self._explored_kind = spec
                self.interval = min(self.interval * 2, MAX_EXPLORE) if same else MIN_EXPLORE
                self._next_explore = self.steps + self.interval
                self.explored += 1
                return trial
        thin = self.estimates.tested[0] < THIN_EVIDENCE  # first blocks have tested position 1 only a few times
        sampling = functools.cache(lambda: short or self._plain_regime(n, False) is not None)  # the sample applies
        new = [
            i
            for i, r in enumerate(req_ids)
            if d.spans[i] < min(probe, remaining[i])
            and (r not in self.drafted or (thin and self.drafted[r] == (1, 0)))
            and not (self.sample.passed(r) and sampling())
            and r not in self.sample.retired
            and r not in self.in_flight
        ]
        if new and n >= PROBE_SAMPLE and sampling():  # (a batch of fewer: every new request)
            new = self.sample.sample(req_ids, new, self.dormancy.due)
        elif new and not spec and n >= PROBE_SAMPLE and len(new) < PROBE_SAMPLE:  # see PROBE_HOLD
            held = self._held_since
            for i in new:
                held.setdefault(req_ids[i], self.steps)
            if all(self.steps - held[req_ids[i]] < PROBE_HOLD for i in new):
                new = []  # a later step probes them together
        if new:  # a request's first step drafts a full block whatever the estimate: its own evidence, at once,
            # and evidence on every position (spans chosen short test only the first few), up to the first
            # position known to fail (AcceptanceEstimates.failing_span)
            for i in new:
                self._held_since.pop(req_ids[i], None)
            spans = _widened(d.spans, new, probe, remaining)
            self.probe_regret_s += self._regret(spans, tables, d)  # not budgeted: paid by their own generation
            self.probes += len(new)
            self.caps[d.cap] += 1
            self.probed = new
            return spans
        if self._reprobes_due(n, self.steps):  # re-probes (small batches): see REPROBE_EVERY
            again = [
                i
                for i, r in enumerate(req_ids)
                if d.spans[i] == 1
                and remaining[i] > b
                and r in self.drafted
                and r not in self.sample.retired
                and r not in self.in_flight
                and self.steps - self._drafted_at[r] >= self.reprobe_every // 2
            ]
            if again:  # (up to the first position known to fail in later blocks, as an exploration)
                spans = _widened(d.spans, again, self.estimates.failing_span(later=True), remaining)
                self.probe_regret_s += self._regret(spans, tables, d, req_ids)
                self.probes += len(again)
                self.reprobes += len(again)
                self.reprobed.update(req_ids[i] for i in again)
                self.caps[d.cap] += 1
                self.probed = again
                return spans
        fresh = [
            i
            for i, r in enumerate(req_ids)
            if d.spans[i] == 1
            and remaining[i] > 1
            and r not in self.sample.retired
            and r not in self.in_flight
            and self._probing(r)
        ]
        if fresh:  # follow-up probes of requests still being learnt, as many as the budget affords
            budget = self._budget(remaining) if budget is None else budget
            trial = _widened(d.spans, fresh[:1], b, remaining)
            one = self._regret(trial, tables, d, req_ids)
            k = len(fresh) if one <= budget else 0  # when one probe is unaffordable, so is any: no search
            while k:
                trial = _widened(d.spans, fresh[:k], b, remaining)
                regret = self._regret(trial, tables, d, req_ids) if k > 1 else one
                if regret <= budget:
                    self.regret_s += regret
                    self.probes += k
                    self.caps[d.cap] += 1
                    self.probed = fresh[:k]
                    return trial
                k //= 2
        return None

    def _pending_rows(self, req_ids: list[int], spans: list[int]) -> int:
        """Context rows the drafting requests of `spans` carry since their last draft, when one carries more than
        a block (the lane then projects them all before the draft, a catch-up); else 0. Read from the proposer
        (`pending`, bound by the scheduler: a prompt's rows and those of a request passed over by the probe sample
        included); unbound, nothing is known to carry: 0."""
        if self.pending is None:
            return 0
        gaps = [self.pending(r) for r, sp in zip(req_ids, spans) if sp > 1]
        return sum(gaps) if gaps and max(gaps) > self.block_size else 0

    def _switch_s(self, req_ids: list[int]) -> float:
        """The catch-up a speculating choice would pay now: the context rows its unretired requests carry past
        a plain stretch (or a prompt), when one carries more than a block (else 0: no catch-up). Charged to every
        speculating candidate of the choice, as if each of them drafted (an upper bound). Without it the trained
        tiny pair at c8 on the H200 (run 97) switched from plain stretches to speculation in 120 of 453
        decisions and back, each such verify step 2.8 ms of wall time where the choice priced ~1.3 ms of draft
        and verify (the rest: a catch-up of 0.66 ms + 0.8 us a row, and host time), and ran 0.80 of plain."""
        out = self.sample.retired
        return self.cost.catch_up_s(self._pending_rows(req_ids, [1 if r in out else 2 for r in req_ids]))

    def _held_probe_due(self, step: int) -> bool:
        """A held first-step probe (PROBE_HOLD) is due by decision `step`. Requests retired or passed over by
        the sample since are dropped first (one that drafted meanwhile, in a speculating choice, was dropped by
        observe_acceptance; one drafted only once may be held again for a repeated first probe, THIN_EVIDENCE):
        a stale entry would keep every later plain decision off the O(1) reuse path for the rest of its
        generation."""
        held = self._held_since
        if not held or min(held.values()) + PROBE_HOLD > step:
            return False
        for r in [r for r in held if r in self.sample.retired or self.sample.passed(r)]:
            del held[r]
        return bool(held) and min(held.values()) + PROBE_HOLD <= step

    def _reprobing(self, n: int) -> bool:
        """A batch of n re-probes its requests decoding plainly (see REPROBE_EVERY): a small one, re-probes on."""
        return bool(self.reprobe_every) and n < PROBE_SAMPLE

    def _reprobes_due(self, n: int, step: int) -> bool:
        """Decision `step` of a batch of n re-probes the requests decoding plainly (see REPROBE_EVERY)."""
        return self._reprobing(n) and step % self.reprobe_every == 0

    def _budget(self, remaining: list[int]) -> float:
        """Seconds of predicted regret exploration may still spend: EXPLORE_BUDGET of the step time so far plus
        the live requests' remaining work at plain speed (a new request's probe is paid for by its own
        generation), less what it has spent."""
        n = len(remaining)
        ahead = sum(remaining) * self.cost.plain_step_s(n) / n
        return EXPLORE_BUDGET * (self.elapsed_s + ahead) - self.regret_s

    def _regret(self, spans: list[int], tables: list[Table], d: Decision, req_ids: list[int] | None = None) -> float:
        """Predicted regret of an exploring choice: its time (with the catch-up of the context its drafting
        requests carry, when `req_ids` are given) minus the time the chosen spans need for the same tokens."""
        n, drafted = len(spans), sum(s > 1 for s in spans)
        if drafted:
            t = self.cost.draft_s(drafted, max(spans)) + self.cost.verify_s(n, self.rows(n, sum(spans)))
            t += self.cost.host_s("verify", n)
            if req_ids is not None:
                t += self.cost.catch_up_s(self._pending_rows(req_ids, spans))
            tokens = sum(e[s] for e, s in zip(tables, spans))
        else:
            t, tokens = self.cost.plain_step_s(n), float(n)
        return max(0.0, t - tokens / d.predicted_tok_per_s)

    def _probing(self, req_id: int) -> bool:
        """After its first-step probe, a request is probed again (a full block despite the choice) until
        PROBE_STEPS drafting steps are seen, while each keeps accepting past what the workload does: something,
        or, where a position is known to fail in first or later blocks (AcceptanceEstimates.failing_span),
        that position. A request that accepts nothing (or no more than the workload's blocks do) is settled
        by one; a request far above the population rate outweighs the prior in a few. (Probed on for
        accepting position 1 when the workload accepts it in 30% of blocks and never position 2, as the
        bench's tau 1.3 profile, every such request stayed unsettled and out of retirement.)"""
        steps, last = self.drafted.get(req_id, (0, 0))
        return steps < PROBE_STEPS and last >= self._surprise()


def _widened(spans: list[int], indices: list[int], span: int, remaining: list[int]) -> list[int]:
    """`spans` with the requests at `indices` drafting `span` (within their remaining budget)."""
    out = list(spans)
    for i in indices:
        out[i] = min(span, remaining[i])
    return out
