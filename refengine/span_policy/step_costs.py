"""GoodputSpans' step-cost table: seconds per step shape (kind, batch bucket, cap): "decode" (a plain step,
cap 1), "verify" (the target over the spans, cap = rows a request), "draft" (cap = rows a block it scores).
Seeded by the captured graphs' timed replays, which leave out the host's work: the first measured step of a
shape replaces its seed, later ones move it by COST_EMA, an unmeasured seed is priced with its kind's mean host
share (measured minus seed), and a shape never timed by a line a + b x rows (a, b >= 0) through its kind's.
A seed is also the shape's floor: no step of it runs faster than its graph's replay (`get(..., floor=True)`),
which exploration prices with, so one slow sample (a first call, a collection) cannot hide a kind for ever.
"""

from __future__ import annotations

import numpy as np

COST_EMA = 0.2  # weight of a new measurement of a shape already measured (steps vary by a few percent)

Key = tuple[str, int, int]


class StepCosts:
    def __init__(self) -> None:
        self.table: dict[Key, float] = {}  # measured (or, until then, seeded) seconds
        self.seeds: dict[Key, float] = {}
        self.measured: set[Key] = set()
        self._host: dict[str, float] = {}  # kind -> mean measured minus seed, cached until the table changes
        self._lines: dict[str, tuple[float, float] | None] = {}  # kind -> (a, b), cached likewise

    def seed(self, kind: str, bucket: int, cap: int, seconds: float) -> None:
        key = (kind, bucket, cap)
        if seconds > 0 and key not in self.measured:
            self.table[key] = self.seeds[key] = seconds
            self._changed(kind)

    def observe(self, kind: str, bucket: int, cap: int, seconds: float) -> None:
        key = (kind, bucket, cap)
        if seconds <= 0:
            return
        if key in self.measured:
            self.table[key] += COST_EMA * (seconds - self.table[key])
        else:
            self.table[key] = seconds
            self.measured.add(key)
        self._changed(kind)

    def _changed(self, kind: str) -> None:
        self._host.pop(kind, None)
        self._lines.pop(kind, None)

    def get(self, kind: str, bucket: int, cap: int, floor: bool = False) -> float | None:
        """Seconds for the shape; None when no shape of its kind is known yet. `floor`: its replay's seconds
        where it was seeded (the least it can cost), else the estimate."""
        key = (kind, bucket, cap)
        if floor and key in self.seeds:
            return self.seeds[key]
        got = self.table.get(key)
        if got is not None:
            return got if key in self.measured else got + self._host_share(kind)
        if kind not in self._lines:
            self._lines[kind] = self._fit(kind)
        line = self._lines[kind]
        return None if line is None else line[0] + line[1] * bucket * cap

    def _host_share(self, kind: str) -> float:
        if kind not in self._host:
            both = [self.table[k] - s for k, s in self.seeds.items() if k[0] == kind and k in self.measured]
            self._host[kind] = max(0.0, float(np.mean(both))) if both else 0.0
        return self._host[kind]

    def _fit(self, kind: str) -> tuple[float, float] | None:
        pts = [(b * c, self.get(k, b, c) or s) for (k, b, c), s in self.table.items() if k == kind]
        if not pts:
            return None
        rows = np.array([p[0] for p in pts], dtype=float)
        secs = np.array([p[1] for p in pts], dtype=float)
        if len(set(rows.tolist())) < 2:
            return float(secs.mean()), 0.0
        b, a = np.polyfit(rows, secs, 1)
        if b < 0:  # noise: no cost per row
            return float(secs.mean()), 0.0
        if a < 0:  # through the origin
            return 0.0, float((rows @ secs) / (rows @ rows))
        return float(a), float(b)
