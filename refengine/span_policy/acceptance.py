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
request the tokens a span s is expected to commit, E_i(s) = 1 + sum_{k<s} prod_{j<=k} a_ij. Counts live in one
array, a row per live request; a step's observations are queued and folded in, all at once, when a table is
read (the policy searches far less often than steps run).
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
        self.counts = np.zeros((8, 2, self.width))  # a row per live request: [passed, tried] as of `since`
        self.since = np.zeros(8, dtype=np.int64)  # the step each row's counts are as of
        self.rows: dict[int, int] = {}  # req -> its row
        self._free = list(range(7, -1, -1))
        self._positions = np.arange(self.width)
        self.step = 0
        self._queued: list[tuple[int, int, int, int]] = []  # (req, span, accepted, step) not folded in yet

    def add(self, req_id: int) -> None:
        if not self._free:  # double the rows
            n = len(self.since)
            self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            self.since = np.concatenate([self.since, np.zeros_like(self.since)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self.rows[req_id] = self._free.pop()
        self.counts[row] = 0.0
        self.since[row] = self.step

    def remove(self, req_id: int) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def advance(self) -> None:
        """One step passed (a decision): every request's evidence fades by REQUEST_DECAY."""
        self.step += 1

    def _faded(self, rows: np.ndarray) -> np.ndarray:
        return self.counts[rows] * (REQUEST_DECAY ** (self.step - self.since[rows]))[:, None, None]

    def observe(self, req_ids: Sequence[int], spans: Sequence[int], accepted: Sequence[int]) -> None:
        """A step's blocks: request req_ids[i] verified spans[i] tokens and accepted accepted[i] drafts (spans of
        1 drafted nothing). Queued until a table is read."""
        step = self.step
        self._queued += [(r, s, m, step) for r, s, m in zip(req_ids, spans, accepted) if s > 1]

    def _fold(self) -> None:
        """Fold the queued blocks in: each weighted by the decay since it was observed."""
        if not self._queued:
            return
        q = np.array(self._queued, dtype=np.int64)  # [M, 4]
        self._queued = []
        span, acc, at = q[:, 1], q[:, 2], q[:, 3]
        passed = (self._positions < acc[:, None]).astype(float)  # [M, B-1]
        tried = (self._positions < np.minimum(acc + 1, span - 1)[:, None]).astype(float)
        m = len(q)
        fade = POPULATION_DECAY ** np.arange(m - 1, -1, -1, dtype=float)[:, None]  # blocks observed after each
        self.population = self.population * POPULATION_DECAY**m + np.stack(
            [(passed * fade).sum(0), (tried * fade).sum(0)]
        )
        live = np.array([self.rows.get(int(r), -1) for r in q[:, 0]])
        keep = live >= 0
        if keep.any():
            rows, w = live[keep], (REQUEST_DECAY ** (self.step - at[keep]))[:, None]
            touched = np.unique(rows)
            self.counts[touched] = self._faded(touched)
            self.since[touched] = self.step
            np.add.at(self.counts[:, 0], rows, passed[keep] * w)
            np.add.at(self.counts[:, 1], rows, tried[keep] * w)

    def rates(self) -> np.ndarray:
        """The population's acceptance rate at each position [B-1]."""
        self._fold()
        return (self.population[0] + 1.0) / (self.population[1] + 2.0)

    def tables(self, req_ids: Sequence[int], z: float | None = None) -> np.ndarray:
        """E_i(s) for s = 1..B, [len(req_ids), B] (column s - 1), from the mean estimate; with `z`, [2, N, B]:
        the mean's and the optimistic estimate's. An unknown request has no evidence of its own."""
        self._fold()
        rows = np.array([self.rows.get(r, -1) for r in req_ids])
        counts = np.where((rows >= 0)[:, None, None], self._faded(np.maximum(rows, 0)), 0.0)  # [N, 2, B-1]
        passed, tried = counts[:, 0], counts[:, 1]
        a = (passed + PRIOR_WEIGHT * self.rates()) / (tried + PRIOR_WEIGHT)
        if z is not None:
            own = (passed + 1.0) / (tried + 2.0)
            a = np.stack([a, np.minimum(np.maximum(a, own + z * np.sqrt(own * (1.0 - own) / (tried + 3.0))), 1.0)])
        reach = np.cumprod(a, axis=-1)  # [..., N, B-1]: chance drafts 1..k all pass
        return np.concatenate([np.ones(a.shape[:-1] + (1,)), 1.0 + np.cumsum(reach, axis=-1)], axis=-1)
