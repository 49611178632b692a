"""The prepared choice (a mixin of AdaptivePolicy, refengine/spec_decode/adaptive.py): a speculating step's
next choice is searched while the step runs.

The host has nothing to do between a verify graph's launch and its one host sync (a few ms at c32), and the
next choice's acceptance tables and span search then ran after the commit, between the GPU's steps: ~0.36 ms
of a ~0.97 ms host step at c32 on the H200 (run 116). So while a speculating step's graph runs the scheduler
asks the policy to prepare (Scheduler.while_waiting): the tables and the search for the requests that will
still be running if none finishes, on what the policy knows then. The next choice takes that search when it is
for the same requests, no choice came between, and it speculates; otherwise it searches as before. Its spans
are thus chosen on the acceptance observed up to the step before the last, as its costs are (cost_samples.py).
Only after a speculating decision (a step drafting only probes or an exploration runs on a plain one, and
a search on what it knew is plain too: the trained tiny pair's c8 probe step ran two searches, H200 run 139).
A prepared plain decision is not taken: held as the cached plain decision, a stale one would hold until an
exploration (plain steps teach nothing), where a fresh search may speculate at once. Nor is one predicting
less than PREPARED_MARGIN over plain: where speculation is marginal, the search speculates on estimates that
noise lifted, the blocks it drafts then regress to the mean and a fresh choice goes back to plain, but the
stale one repeats it, and as a decision to speculate it holds off the plain regime and retirement. In
simulation, steady sharegpt arrivals at c32 ran 0.897 / 0.977 / 0.897 of plain on three paths that way,
against 0.946 / 0.931 / 0.950 choosing fresh (with the margin: 0.946 / 0.942 / 0.950).

Measured on the H200 in one process, paired round by round against the same engine choosing after the commit
(run 121, sharegpt waves, before the margin; the last decisions of run 122's c16 / c32 rows predicted 1.13 /
1.25 x plain, over the margin): 1.044 at c32, 1.064 at c16, 1.024 at c1. With the margin against without it
(run 125, the same way): 1.032 at c32, 1.001 at c16 and c1. In simulation, which has no host time, the stale
estimates alone cost nothing beyond noise elsewhere (tests/unit/test_prepared_choice.py).
"""

from __future__ import annotations

from typing import NamedTuple

from refengine.spec_decode.acceptance_estimate import AcceptanceEstimates
from refengine.spec_decode.span_choice import Decision, RowsFn, Table, choose_spans, executed_rows
from refengine.spec_decode.step_costs import CostModel

PREPARED_MARGIN = 1.1  # a prepared search is taken only where it predicts speculation this much faster than plain


class Prepared(NamedTuple):
    at: int  # the policy's decisions when it was prepared (taken only by the next one)
    key: tuple  # (version, request ids) of its tables
    tables: list[Table]
    decision: Decision


class PreparedChoice:
    # what AdaptivePolicy provides
    block_size: int
    cost: CostModel
    rows: RowsFn
    estimates: AcceptanceEstimates
    steps: int
    prepared: int
    prepared_margin: float
    _version: int
    _executed: dict[int, tuple[int, ...]]
    _tables: tuple[tuple, list[Table]] | None
    _prepared: Prepared | None
    last: Decision | None

    @property
    def retired(self) -> set[int]:
        raise NotImplementedError

    def _switch_s(self, req_ids: list[int]) -> float:
        raise NotImplementedError

    def prepare(self, req_ids: list[int], remaining: list[int]) -> None:
        """The next choice's tables and span search for these requests (`remaining`: their budgets after the
        current step as known now, an upper bound), done now (see the module docstring). Not after a plain
        decision (a step that drafts only probes or an exploration): a search on what that decision knew is plain
        too, and a prepared plain decision is not taken."""
        self._prepared = None
        if self.last is not None and self.last.cap > 1 and req_ids and max(remaining) > 1:
            key = (self._version, tuple(req_ids))
            tables = self._tables_of(key, req_ids)
            self._prepared = Prepared(self.steps, key, tables, self._span_search(req_ids, remaining, tables))

    def drop_prepared(self) -> None:
        self._prepared = None

    def _take_prepared(self, req_ids: tuple[int, ...]) -> tuple[list[Table], Decision] | None:
        """The prepared (tables, decision) if this choice may take it (see the module docstring); either way
        it is used up."""
        ready, self._prepared = self._prepared, None
        if ready is None or ready.at != self.steps or ready.key[1] != req_ids:
            return None
        d = ready.decision
        if d.cap == 1 or d.predicted_tok_per_s < self.prepared_margin * d.plain_tok_per_s:
            return None
        self._tables = (ready.key, ready.tables)  # (the exploration's and the retirement's tables too)
        self.prepared += 1
        return ready.tables, d

    def _tables_of(self, key: tuple, req_ids: list[int]) -> list[Table]:
        """E tables of the requests, a pure function of the observations (the version) and the requests:
        reused across the exploration checks of a settled plain stretch (32 requests': ~0.25 ms, 2-core CPU)."""
        if self._tables is None or self._tables[0] != key:
            tables = self.estimates.tables(req_ids)
            if self.retired:  # a retired request commits one token whatever its span: it never drafts
                flat = [0.0] + [1.0] * self.block_size
                tables = [flat if r in self.retired else t for r, t in zip(req_ids, tables)]
            self._tables = (key, tables)
        return self._tables[1]

    def _span_search(self, req_ids: list[int], remaining: list[int], tables: list[Table]) -> Decision:
        n = len(req_ids)
        if n not in self._executed:
            self._executed[n] = executed_rows(self.rows, n, self.block_size)
        switch = self._switch_s(req_ids)
        return choose_spans(tables, remaining, self.block_size, self.cost, self.rows, self._executed[n], switch)
