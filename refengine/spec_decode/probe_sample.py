"""Adaptive speculation's probe sample and retirements (pure Python): which new requests are probed while the
first blocks fail position 1 or plain decode has settled in, and which requests stop speculating for good.

The sample. While the first blocks accept position 1 at under SHORT_PROBE_RATE on ample evidence, or in a
plain regime (refengine/spec_decode/retirement.py: no decision to speculate and no surprising block for RETIRE_AFTER
decisions, and a uniform batch of the workload's later blocks losing to plain at this batch size; the bench's
tau 1.3 profile), in a batch of PROBE_SAMPLE requests or more, only every PROBE_SAMPLE-th new request is
probed (in a smaller batch every one: at c1, sampled, a workload turning good was seen only every
PROBE_SAMPLE-th request; in simulation, acceptance 0.85 after a long stretch of 0: 0.24 of the better mode,
against 0.70 probing each): the rest decode plainly from their first step (their table is the first blocks')
and are probed as soon as neither holds (or retire, below). A probe pays the catch-up of its prompt's context
(H200 run 53, c32: a probe wave ~9 ms over a 4.6 ms plain step, ~1.4% of a 128-token wave), and the decode
steps after a drafter's work ran slower (run 64, tau 1.3, every request probed: 4.55 against 4.29 ms at
c16). The sample still tests the workload at every PROBE_SAMPLE new requests: a surprising first block (one
accepting position 1 while it fails, or a position known to fail: Retirement._surprise) ends the plain
regime, so a workload turning good is seen within that many.

Retirement. While position 1 fails in later blocks too (on ample evidence), or in a plain regime, a request
the decision leaves at span 1 is retired once the evidence is its own or fresh: its own last block was in
line with the workload (accepted nothing, where position 1 fails) and it is not being probed on, or it was
passed over by the sample and a first block observed since then was in line too, none surprising (a request
passed over with none probed beside it, as at c1: the latest first block); in a plain regime its own
uniform batch must lose to plain as well (not in a batch of PROBE_SAMPLE or more, where the regime itself says
no step found its drafting worth it), and in a batch small enough to re-probe a re-probe of its own must
have been in line too (refengine/spec_decode/retirement.py). A retired request never drafts again: its steps
need no tap features, the scheduler frees its drafter context, and it rides along at span 1 in any plan; a batch of
retired requests runs plain decode's own step (the decode graph without taps: writing them cost 0.4-1.3% of
a step on the H200, run 55) with no policy, cost sample or drafter bookkeeping. The requests retired stay
plain for the rest of their generation (also if their batch shrinks to a size where speculating would win:
there is no way back yet); a workload turning good is seen by the sample's probes of new requests. Only with
later blocks tested: a drafter whose first block after the prompt fails and later ones accept (the trained
tiny pair's first blocks, 0-3 accepted against 15) must keep being explored. Only on fresh evidence: retired
at the pass-over, a wave of requests arriving as the workload turned good stayed plain (simulation, c8,
acceptance 0 then 0.85: 0.79 of the better mode, against 1.04 without retirement).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PROBE_SAMPLE = 8  # while first-step probes are short, only every PROBE_SAMPLE-th new request is probed


@dataclass
class ProbeSample:
    unprobed: int = 0  # new requests passed over by the sample
    retirements: int = 0  # requests retired so far
    retired_by: Counter = field(default_factory=Counter)  # "<regime> / <evidence> / batch <n>" -> retirements
    retired: set[int] = field(default_factory=set)  # live requests retired from speculation
    _passed: dict[int, int] = field(default_factory=dict)  # live requests passed over -> first blocks seen by then
    _new_seen: int = 0  # new requests the sample has counted
    _first_seen: int = 0  # first blocks observed
    _first_surprise_at: int = 0  # _first_seen at the last surprising first block (one accepting position 1, while
    # it fails; past the position known to fail, in a plain regime: Retirement._surprise)
    _newly_retired: list[int] = field(default_factory=list)  # since the scheduler last took them

    def passed(self, req_id: int) -> bool:
        return req_id in self._passed

    def sample(self, req_ids: list[int], new: list[int], keep: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The new requests (indices into req_ids) probed while first-step probes are short: every
        PROBE_SAMPLE-th of them in arrival order, the first one included; the others are passed over. Those in
        `keep` (a dormant policy's probes: dormancy.py) are probed and not counted."""
        kept, passed = [], []
        for i in new:
            if req_ids[i] in keep:
                kept.append(i)
                continue
            if self._new_seen % PROBE_SAMPLE == 0:
                kept.append(i)
            else:
                passed.append(req_ids[i])
                self.unprobed += 1
            self._new_seen += 1
        # what a passed-over request's retirement waits for: the first block of a request probed with it, or,
        # when none is (requests arriving one at a time), none: the latest first block seen must have failed
        seen = self._first_seen if kept else self._first_seen - 1
        for r in passed:
            self._passed[r] = seen
        return kept

    def observe_first_block(self, surprising: bool) -> None:
        """A request's first block was verified; `surprising`: it accepted more than the workload's do."""
        self._first_seen += 1
        if surprising:
            self._first_surprise_at = self._first_seen

    def settled(self, req_id: int) -> bool:
        """A request passed over by the sample has fresh evidence: a first block observed since then, none of
        them surprising (see the module docstring)."""
        seen = self._passed.get(req_id)
        return seen is not None and self._first_surprise_at <= seen < self._first_seen

    def retire(self, req_id: int, why: str = "", at_admission: bool = False) -> None:
        """`why`: the rule and batch size that retired it (the stats' retired_by). `at_admission`: before its
        prefill (dormancy.py), so the scheduler, which asked, holds nothing for it to free (not in take_retired)."""
        self.retired.add(req_id)
        self.retired_by[why] += 1
        if not at_admission:
            self._newly_retired.append(req_id)
        self.retirements += 1

    def take_retired(self) -> list[int]:
        out, self._newly_retired = self._newly_retired, []
        return out

    def release(self, req_id: int) -> None:
        self._passed.pop(req_id, None)
        self.retired.discard(req_id)
