"""The host's share of the critical path: from the last time the host waited for the device (reading results
back) to the next graph replay being queued, the device has nothing to run (bench_steps' critical ms)."""

from __future__ import annotations

import time


class CriticalPathClock:
    """Host time from the last sync to the next graph replay being queued (the device idles for it), added to
    timings["critical_s"]. The graph runners hold it, not the ModelRunner: no reference cycle keeps a dropped
    engine's pools alive until a collection."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings
        self.synced_at: float | None = None

    def synced(self) -> float:
        self.synced_at = time.perf_counter()
        return self.synced_at

    def launching(self) -> None:
        if self.synced_at is not None:
            self.timings["critical_s"] += time.perf_counter() - self.synced_at
            self.synced_at = None
