"""Per-request, per-position acceptance estimates shrunk toward the population (GoodputSpans' acceptance).

a(j), j = 1..B-1: the chance draft j is accepted given drafts 1..j-1 were. A verify that accepted m of its
s - 1 drafts tried positions 1..min(m + 1, s - 1) and passed 1..m. Evidence fades: a request's counts by
REQUEST_DECAY a step (so a request that stopped drafting becomes uncertain again), the population's by
POPULATION_DECAY a block observed.
    population  p_j = (passed_j + 1) / (tried_j + 2)
    mean        a_ij = (passed_ij + PRIOR_WEIGHT p_j) / (tried_ij + PRIOR_WEIGHT)
    optimistic  max(a_ij, o_ij + z sqrt(o_ij (1 - o_ij) / (tried_ij + 3))),  o_ij = (passed_ij + 1) / (tried_ij + 2)
The mean starts a new request at the population's rate and moves it to its own as it drafts. The optimistic
estimate asks what the request's own evidence cannot rule out (a uniform prior, not the population's: a
workload whose requests never accepted may have turned), which is how exploration finds out. `tables` gives per
request the tokens a span s is expected to commit, E_i(s) = 1 + sum_{k<s} prod_{j<=k} a_ij.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PRIOR_WEIGHT = 4.0  # pseudo-trials a request borrows from the population's rate at each position
REQUEST_DECAY = 0.95  # weight a request's evidence keeps per step (its text can turn, e.g. start to loop)
POPULATION_DECAY = 0.995  # weight the population's evidence keeps per block drafted (the workload changes slowly)


class AcceptanceEstimates:
    def __init__(self, block_size: int):
        self.width = block_size - 1  # draft positions 1..B-1
        self.population = np.zeros((2, self.width))  # [passed, tried] per position
        self.requests: dict[int, tuple[np.ndarray, int]] = {}  # req -> ([passed, tried] per position, as of step)
        self.step = 0

    def add(self, req_id: int) -> None:
        self.requests[req_id] = (np.zeros((2, self.width)), self.step)

    def remove(self, req_id: int) -> None:
        self.requests.pop(req_id, None)

    def advance(self) -> None:
        """One step passed (a decision): every request's evidence fades by REQUEST_DECAY."""
        self.step += 1

    def _current(self, req_id: int) -> np.ndarray | None:
        got = self.requests.get(req_id)
        if got is None:
            return None
        counts, at = got
        if at != self.step:
            counts *= REQUEST_DECAY ** (self.step - at)
            self.requests[req_id] = (counts, self.step)
        return counts

    def observe(self, req_id: int, span: int, accepted: int) -> None:
        """A block of span - 1 drafts of which the first `accepted` were accepted."""
        if span < 2:
            return
        tried = min(accepted + 1, span - 1)
        own = self._current(req_id)
        self.population *= POPULATION_DECAY
        for counts in (own, self.population):
            if counts is not None:
                counts[0, :accepted] += 1.0
                counts[1, :tried] += 1.0

    def rates(self) -> np.ndarray:
        """The population's acceptance rate at each position [B-1]."""
        return (self.population[0] + 1.0) / (self.population[1] + 2.0)

    def tables(self, req_ids: Sequence[int], z: float = 0.0) -> np.ndarray:
        """E_i(s) for s = 1..B, [len(req_ids), B] (column s - 1): the mean (z = 0) or optimistic estimate."""
        empty = np.zeros((2, self.width))
        counts = np.stack([c if (c := self._current(r)) is not None else empty for r in req_ids])  # [N, 2, B-1]
        passed, tried = counts[:, 0], counts[:, 1]
        a = (passed + PRIOR_WEIGHT * self.rates()) / (tried + PRIOR_WEIGHT)
        if z:
            own = (passed + 1.0) / (tried + 2.0)
            a = np.minimum(np.maximum(a, own + z * np.sqrt(own * (1.0 - own) / (tried + 3.0))), 1.0)
        reach = np.cumprod(a, axis=1)  # [N, B-1]: chance drafts 1..k all pass
        return np.concatenate([np.ones((len(req_ids), 1)), 1.0 + np.cumsum(reach, axis=1)], axis=1)
