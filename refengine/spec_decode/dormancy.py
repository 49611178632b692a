"""Adaptive speculation's dormancy (pure Python): once speculation has settled into not paying, new requests
stop paying for a look each.

In a retirement regime (position 1 failing in first and later blocks, or a plain regime at the batch size a
request joins: refengine/spec_decode/retirement.py) every request still pays for the policy's look at it:
its prefill writes tap features for the drafter, and its first step (or, in a batch of PROBE_SAMPLE or
more, one step a wave) is a verify of a probe block, before it retires. At Qwen3-4B shapes on the H200 at
tau 1 that was a 2.4 ms prefill premium and a ~2 ms probe step on a 540 ms request at c1 (0.85%), and one
verify step a wave at c8-c32 (0.35-0.55%): adaptive ran 0.98-0.99 of plain where nothing can be gained
(docs/PERF.md, runs 89-91 and 96). Where the workload has shown nothing but that for DORMANT_AFTER first
blocks in a row (none surprising: Retirement._surprising_by_kind), the policy is dormant: a new request is admitted
retired (its prefill writes no taps, it holds no drafter context, it never drafts: plain decode's own path
from its first step), except when the work admitted since the last probe pays for one: DORMANT_SHARE of
that work's plain decode time, against the predicted cost of a probe step (AdaptivePolicy.admit). That
request is probed as any new one (the probe sample does not pass it over), and its first block is the
dormant policy's sentinel: a surprising block anywhere ends dormancy at once, judged by each kind of batch's
own rule (at c1 a block accepting position 1 can surprise while the same block is ordinary at c8-c32), and
new requests are probed as before (each one in a small batch, a sample of them in a larger one) until
DORMANT_AFTER calm first blocks again. So a stationary poor workload pays for its looks a few times
DORMANT_SHARE (a probe's prefill premium and part of its step are not in the predicted cost: in simulation
with the H200's costs 0.5% at c1 and c32 against 1.0-1.1% without dormancy, tests/unit/test_dormancy.py), and
a turn is seen within the work that pays for one probe (at Qwen3-4B shapes on the H200 about 4 requests of
128 tokens at c1, 3 waves at c32).

Not where nothing is known to fail and a wave's probe step is cheap beside its work (Retirement._awake_is_cheap,
DORMANT_PRICE): there a turn surprises only past the workload's odds, and dormant it was seen too late (in
simulation 0.33-0.99 of the better mode after the turn, against 0.80-1.07 awake); the trained tiny pair's probe
steps are dear beside its short plain steps, and it stays dormant as before.

Only at a batch size where the regime holds, and in a plain regime on calm blocks of its own kind of batch
(smaller than PROBE_SAMPLE, or not; where position 1 fails everywhere, calm blocks of any): the trained tiny
pair speculates at c1 (fixed DFlash ~3x plain) and loses at c32, and a drafter whose first blocks are poor
and later ones good looks hopeless in a phase of short requests at c32, where the probe sample passes most
requests over and the rest retire; then at c1 its requests are each probed and probed on (in simulation,
test_poor_first_blocks_do_not_lock_adaptive_into_plain: admitted retired on the c32 phase's calm, a c1 phase
ran at plain's speed, 0.29 of fixed spans).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refengine.spec_decode.probe_sample import PROBE_SAMPLE

DORMANT_AFTER = 16  # first blocks in a row, judged in a retirement regime, none surprising, before dormancy
DORMANT_SHARE = 0.001  # dormant: probes of new requests may cost this share of the admitted work's plain time
DORMANT_PRICE = 0.007  # nothing known to fail: no dormancy where a probe step costs under this share of the wave's
# plain time (Qwen3-4B shapes on the H200 ~0.4%, the trained tiny pair 1.3-2.3%: Retirement._awake_is_cheap)


@dataclass
class Dormancy:
    # first blocks in a row judged in a retirement regime, none surprising (since any surprise), by the kind of
    # batch they were drafted in: [smaller than PROBE_SAMPLE, PROBE_SAMPLE or more]
    calm: list[int] = field(default_factory=lambda: [0, 0])
    credit_s: float = 0.0  # DORMANT_SHARE of the plain time of the work admitted dormant, less the probes' cost
    admitted: int = 0  # new requests admitted retired
    probes: int = 0  # new requests admitted to be probed while dormant
    due: set[int] = field(default_factory=set)  # dormant probes whose first block is not in yet
    # by kind of batch, as calm: dormancy was entered (a new request admitted retired or as its probe) since the
    # last surprise; the entry's condition (Retirement._awake_is_cheap) is not asked again until one
    entered: list[bool] = field(default_factory=lambda: [False, False])
    # large batches where a probe step is dear: a lone block past the rare count, in doubt (RareBlocks._doubt):
    # [blocks judged since it opened, itself included; those past the rare count]. Not dormant there while open
    doubt: list[int] | None = None
    doubts: list[int] = field(default_factory=lambda: [0, 0])  # doubts opened, confirmed as surprises (stats)

    def dormant(self, batch: int, fails: bool = False) -> bool:
        """Dormant at this batch size: DORMANT_AFTER calm first blocks of its kind of batch, or of any kind
        where position 1 fails in first and later blocks alike (`fails`: nothing is accepted at all, so no
        batch size or request length can make drafting pay); in a large batch, not while a doubt is open (its
        new requests are probed as an awake policy's, to settle it)."""
        if fails:
            return sum(self.calm) >= DORMANT_AFTER
        large = batch >= PROBE_SAMPLE
        return self.calm[large] >= DORMANT_AFTER and not (large and self.doubt is not None)

    def observe_first_block(self, req_id: int, surprising: tuple[bool, bool], retiring_batch: int | None) -> None:
        """A request's first block, drafted in a retirement regime at batch size `retiring_batch` (None: not
        in one): calm grows while such blocks are in line, by the rule of the kind of batch it was drafted in
        (`surprising`: by small batches' rule, by large ones'; the caller's surprise() resets the calm)."""
        self.due.discard(req_id)
        if retiring_batch is not None:
            kind = retiring_batch >= PROBE_SAMPLE
            if not surprising[kind]:
                self.calm[kind] += 1

    def surprise(self, small: bool, large: bool) -> None:
        """A block (first or later) judged by each kind of batch's rule (Retirement._surprising_by_kind): a kind
        it surprises is not dormant until DORMANT_AFTER calm first blocks again. A block surprising in large
        batches surprises small ones too (their rule is the stricter); a block drafted in a small batch is not
        judged by the large rule (Retirement._surprising_by_kind). A c1 cell's blocks speculating well reset the
        large calm, and the c8 cell after it ran awake: in simulation (tiny costs, 1 request in 4 never turning
        good, the bench's order with c1 first) c8 / c16 read 0.943 / 0.985 of plain, 0.960 / 0.996 without that
        reset; on the H200 such a c8 cell read 0.887 (run 154). A large batch's turn is seen by its own probes,
        as when dormant, and through the population's rates."""
        if small:
            self.calm[0] = 0
            self.credit_s = 0.0
            self.entered[0] = False
        if large:
            self.calm[1] = 0
            self.entered[1] = False
            self.doubt = None  # (confirmed, or overtaken)

    def admit(self, req_id: int, work_s: float, probe_s: float) -> bool:
        """While dormant, a new request whose work (`work_s`: its tokens at plain decode's time a token) joins
        the credit: True when it is admitted retired, False when the credit pays for a probe (`probe_s`, the
        predicted cost of its probe step) and it is admitted to be probed."""
        self.credit_s += DORMANT_SHARE * work_s
        if self.credit_s >= probe_s:
            self.credit_s -= probe_s
            self.probes += 1
            self.due.add(req_id)
            return False
        self.admitted += 1
        return True

    def release(self, req_id: int) -> None:
        self.due.discard(req_id)
