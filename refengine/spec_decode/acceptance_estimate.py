"""Per-position acceptance estimates of adaptive speculation (pure Python): what a verify span S is expected to
commit for each request, E_i(S) = 1 + sum over k < S of prod over j <= k of h_ij, where h_ij is the chance
that draft j is accepted given drafts 1..j-1 were.

Why per position, not one geometric rate: the bench's fixed-tau profiles accept exactly m drafts, and real
drafters' acceptance falls along the block. A geometric fit to "2 accepted every step" (tau 3) predicts
E(3) = 2.1 and E(16) = 3.0, so it chose spans 5-10 where span 3 commits the same 3 tokens with a verify a
quarter the size (H200, c32: adaptive 0.87 of plain, docs/PERF.md). Per position, E(3) = E(16) = 3.

Observations: a verify of span S accepting m drafts tested positions 1..min(m + 1, S - 1): 1..m accepted,
m + 1 rejected (when m < S - 1); later positions were not tested and keep their evidence. Decayed counts,
each shrunk toward the level above (so a new request starts at what the workload accepts, and a position
the workload rarely reaches falls back to the pooled rate):
- pooled rate A = (accepted + 0.5) / (accepted + rejected + 1) over every observation (POP_DECAY each): the
  geometric estimate, the prior of every position;
- first blocks' population f_k = (S_k + POSITION_WEIGHT * f_(k-1)) / (T_k + POSITION_WEIGHT), f_0 = A, over
  each request's first drafting step, counts decayed by POP_DECAY per observation testing position k. The
  prior of a position is the one before it, not A: spans chosen short (3 at tau 3) accept everything they
  test, so A climbs toward 1, and positions past the first rejection are never tested; with A as their
  prior E(8) came out 3.85 against the true 3;
- later blocks' population h_k = (S'_k + FIRST_BLOCK_WEIGHT * f_k) / (T'_k + FIRST_BLOCK_WEIGHT) over every
  other drafting step: with no later evidence it is the first blocks' rate. Apart because a drafter's first
  block after the prompt can differ from the rest: the trained tiny pair's accepts 0-3 drafts where its
  later blocks often accept all 15. Pooled, the first-step probes of every new request outvoted the few
  later blocks the policy ever drafted, and it never drafted at c1 where fixed DFlash ran 3x faster (H200,
  runs 43-44). A new request's table is the first blocks' (its next block is its first);
- request h_ik = (s_ik + PRIOR_WEIGHT * h_k) / (t_ik + PRIOR_WEIGHT), decayed by DECAY per observation of
  that request testing k (its first block included).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import numpy as np

DECAY = 0.9  # per observation of a request testing a position
POP_DECAY = 0.95  # per observation testing a position: the population follows the workload over ~20 of them
PRIOR_WEIGHT = 8.0  # pseudo-observations of the population rate in a request's own estimate (noise shrinkage)
POSITION_WEIGHT = 2.0  # pseudo-observations of the previous position's rate in a position's population rate
FIRST_BLOCK_WEIGHT = 1.0  # pseudo-observations of the first blocks' rate in a later-block population rate
ARRAY_TABLES = 8  # from this many requests with evidence, their tables are computed as one array (_tables_array)
SHORT_PROBE_RATE, SHORT_PROBE_EVIDENCE = 0.05, 16.0  # a position accepting at under this rate, tested at least
# that often (decayed), is known to fail: probes and explorations draft no further (failing_span)


def table_from_rates(rates: list[float]) -> list[float]:
    """[E(0), E(1), ..., E(len(rates) + 1)] from per-position conditional acceptance rates (E(0) = 0)."""
    survival = itertools.accumulate(rates, operator.mul)  # P(drafts 1..k all accepted)
    return [0.0, *itertools.accumulate(survival, initial=1.0)]


def _tables_array(own: list[tuple[list[float], list[float]]], pop: list[float]) -> list[list[float]]:
    """table_from_rates(AcceptanceEstimates._own_rates(o, pop)) for each o in `own`, as one array pass: the
    same operations in the same order, so the same floats (~4x faster at 32 requests on a 2-core CPU, where the
    per-request Python was ~0.2 ms of every speculating step's choice; the policy recomputes every table after
    each observation, as the population's rates move)."""
    m, k = len(own), len(pop)
    s = np.fromiter(itertools.chain.from_iterable(o[0] for o in own), float, m * k).reshape(m, k)
    t = np.fromiter(itertools.chain.from_iterable(o[1] for o in own), float, m * k).reshape(m, k)
    w = PRIOR_WEIGHT
    rates = (s + w * np.asarray(pop)) / (t + w)  # (m, B-1)
    e = np.ones((m, k + 2))  # (m, B+1): [0, 1, 1 + s_1, 1 + s_1 + s_2, ...], summed left to right as accumulate
    np.cumprod(rates, axis=1, out=e[:, 2:])
    np.cumsum(e[:, 1:], axis=1, out=e[:, 1:])
    e[:, 0] = 0.0
    return e.tolist()


def geometric_table(alpha: float, block: int) -> list[float]:
    """E(s) for s = 0..block when every position accepts with the same rate alpha (tests, priors)."""
    return table_from_rates([alpha] * (block - 1))


@dataclass
class AcceptanceEstimates:
    """Decayed per-position counts for each live request and for the population."""

    block_size: int
    requests: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)  # req -> (accepted, tested)
    pooled: tuple[float, float] = (0.0, 0.0)  # every observation's (accepted drafts, rejections), decayed
    accepted: list[float] = field(default_factory=list)  # population, per position 1..B-1: first blocks
    tested: list[float] = field(default_factory=list)
    later_accepted: list[float] = field(default_factory=list)  # the same, over every later block
    later_tested: list[float] = field(default_factory=list)
    observations: int = 0  # observe() calls that tested a position: the population's version
    _memo: dict = field(default_factory=dict)  # population functions of this version: computed once each

    def __post_init__(self) -> None:
        n = self.block_size - 1
        self.accepted, self.tested = [0.0] * n, [0.0] * n
        self.later_accepted, self.later_tested = [0.0] * n, [0.0] * n

    def _memoised(self, key: str, compute):
        """compute() once per population version: a decision asks for the same rates up to ~6 times (the
        tables, the probe sample, retirements, surprises; ~80 us a c1 step on the dev CPU). Read only."""
        hit = self._memo.get(key)
        if hit is not None and hit[0] == self.observations:
            return hit[1]
        value = compute()
        self._memo[key] = (self.observations, value)
        return value

    def pooled_rate(self) -> float:
        s, f = self.pooled
        return (s + 0.5) / (s + f + 1.0)  # 0.5 before any evidence

    def first_block_rates(self) -> list[float]:
        """h_k for positions 1..B-1 of a request's first block."""
        return self._memoised("first", self._first_block_rates)

    def _first_block_rates(self) -> list[float]:
        prior, w, out = self.pooled_rate(), POSITION_WEIGHT, []
        for s, t in zip(self.accepted, self.tested):
            prior = (s + w * prior) / (t + w)
            out.append(prior)
        return out

    def population_rates(self, first: list[float] | None = None) -> list[float]:
        """h_k for positions 1..B-1 of later blocks, each shrunk toward the first blocks' rate there (`first`:
        first_block_rates(), when the caller has it)."""
        if first is None:
            return self._memoised("later", lambda: self.population_rates(self.first_block_rates()))
        w = FIRST_BLOCK_WEIGHT
        return [(s + w * h) / (t + w) for s, t, h in zip(self.later_accepted, self.later_tested, first)]

    def unlikely_count(self, first: bool, odds: float) -> int:
        """The fewest accepted drafts that blocks of the kind (`first`: first blocks, else later ones) reach in
        under `odds` of cases, P(m >= k) = prod of the rates of positions 1..k; past the block (never reached
        so rarely): block_size."""
        rates = self.first_block_rates() if first else self.population_rates()
        survival = 1.0
        for k, h in enumerate(rates, start=1):
            survival *= h
            if survival < odds:
                return k
        return self.block_size

    def failing_span(self, later: bool = False) -> int:
        """The span that tests positions 1..k of a first (`later`: a later) block, k the first position known
        to fail: accepting at under SHORT_PROBE_RATE on SHORT_PROBE_EVIDENCE tests (decayed). A block rejected
        there tests nothing past it, and positions past it are reached in under that share of blocks; the full
        block when no position is known to fail. (The bench's tau 1.3 profile accepts position 1 in 30% of
        blocks and never position 2: span 3, against 16; at c32 on Qwen3-4B shapes a 128-row verify, not 512.)"""
        return self._memoised("failing later" if later else "failing", lambda: self._failing_span(later))

    def fails_somewhere(self, evidence: float) -> bool:
        """A position of first or later blocks accepts at under SHORT_PROBE_RATE on `evidence` tests (decayed):
        failing_span's test on other evidence (Retirement._awake_is_cheap asks it on half)."""
        return self._memoised(
            f"fails {evidence}",
            lambda: min(self._failing_span(False, evidence), self._failing_span(True, evidence)) < self.block_size,
        )

    def _failing_span(self, later: bool, evidence: float = SHORT_PROBE_EVIDENCE) -> int:
        rates, tested = (
            (self.population_rates(), self.later_tested) if later else (self.first_block_rates(), self.tested)
        )
        for k, (rate, t) in enumerate(zip(rates, tested), start=1):
            if t >= evidence and rate < SHORT_PROBE_RATE:
                return k + 1
        return self.block_size

    def rates(self, req_id: int, population: list[float] | None = None) -> list[float]:
        """The request's h_ik for positions 1..B-1 (pass population_rates() to reuse it)."""
        pop = self.population_rates() if population is None else population
        own = self.requests.get(req_id)
        return pop if own is None else self._own_rates(own, pop)

    @staticmethod
    def _own_rates(own: tuple[list[float], list[float]], pop: list[float]) -> list[float]:
        w = PRIOR_WEIGHT
        return [(s + w * h) / (t + w) for s, t, h in zip(own[0], own[1], pop)]

    def tables(self, req_ids: list[int]) -> list[list[float]]:
        """E_i(s) for s = 0..B per request; a request with no evidence of its own (its next block is its first)
        gets the first blocks' table."""
        first, pop = self.first_block_rates(), self.population_rates()
        own = [self.requests.get(r) for r in req_ids]
        known = [o for o in own if o is not None]
        if len(known) >= ARRAY_TABLES:
            computed = iter(_tables_array(known, pop))
        else:
            computed = (table_from_rates(self._own_rates(o, pop)) for o in known)
        shared = table_from_rates(first) if len(known) < len(own) else []
        return [shared if o is None else next(computed) for o in own]

    def observe(self, req_id: int, span: int, accepted: int, first: bool | None = None) -> None:
        """A verify of `span` rows (span - 1 drafts) that accepted `accepted` drafts. `first`: it is the block
        right after the request's prompt, a first block (default: when the request has no evidence yet; a request
        that decoded plainly before its first draft drafts a later block)."""
        if span <= 1:
            return  # no drafts: nothing learnt
        self.observations += 1
        tested = min(accepted + 1, span - 1)
        own = self.requests.get(req_id)
        first = own is None if first is None else first
        pop_s, pop_t = (self.accepted, self.tested) if first else (self.later_accepted, self.later_tested)
        if own is None:
            n = self.block_size - 1
            own = self.requests[req_id] = ([0.0] * n, [0.0] * n)
        for k in range(tested):
            hit = 1.0 if k < accepted else 0.0
            own[0][k] = DECAY * own[0][k] + hit
            own[1][k] = DECAY * own[1][k] + 1.0
            pop_s[k] = POP_DECAY * pop_s[k] + hit
            pop_t[k] = POP_DECAY * pop_t[k] + 1.0
        s, f = self.pooled
        self.pooled = (POP_DECAY * s + accepted, POP_DECAY * f + (1.0 if accepted < span - 1 else 0.0))

    def release(self, req_id: int) -> None:
        self.requests.pop(req_id, None)

    def summary(self) -> dict:
        return {
            "pooled_acceptance_rate": round(self.pooled_rate(), 4),
            "position_acceptance_rates": [round(h, 3) for h in self.population_rates()],
            "first_block_acceptance_rates": [round(h, 3) for h in self.first_block_rates()],
        }
