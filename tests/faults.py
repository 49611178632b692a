"""Fault injection for engine tests: make one point of a live engine raise InjectedFault, and record which
requests were in the plan that failed.

Points: 'prefill' / 'decode' / 'verify' (the target forward of that kind of plan), 'draft' (proposer.propose),
'stage' (proposer.stage_features or stage_step: features of some requests already staged), 'commit' (Scheduler._append
inside commit: the plan's earlier requests already committed, a refengine bug by construction). Calls of the
point are counted from 0; calls at..at+times-1 raise, before the real call or just after it (`after`: the
KV, staged features or drafter flush it wrote stay behind for the rollback to undo).
"""

from __future__ import annotations

from refengine import Engine

POINTS = ("prefill", "decode", "verify", "draft", "stage", "commit")


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, engine: Engine, point: str, at: int = 0, times: int = 1, after: bool = False):
        assert point in POINTS, point
        self.point, self.at, self.times, self.after = point, at, times, after
        self.calls = 0
        self.fired = 0
        self.affected: set[int] = set()  # requests of every plan in which a fault fired
        self._plan = None
        self._kind = ""
        runner, sched = engine.runner, engine.scheduler

        def execute(plan, _orig=runner.execute):
            self._plan, self._kind = plan, type(plan).__name__.removesuffix("Plan").lower()
            return _orig(plan)

        def commit(plan, result, _orig=sched.commit):
            self._plan, self._kind = plan, "commit"
            return _orig(plan, result)

        runner.execute = execute  # type: ignore[method-assign]
        sched.commit = commit  # type: ignore[method-assign]
        if point in ("prefill", "decode", "verify"):
            engine.target.forward = self._wrap(engine.target.forward, kind=point)  # type: ignore[method-assign]
        elif point == "draft":
            engine.proposer.propose = self._wrap(engine.proposer.propose)  # type: ignore[union-attr]
        elif point == "stage":
            engine.proposer.stage_features = self._wrap(engine.proposer.stage_features)  # type: ignore[union-attr]
            engine.proposer.stage_step = self._wrap(engine.proposer.stage_step)  # type: ignore[union-attr]
        else:
            sched._append = self._wrap(sched._append)  # type: ignore[method-assign]

    def _wrap(self, fn, kind: str | None = None):
        def wrapped(*a, **kw):
            if kind is not None and self._kind != kind:
                return fn(*a, **kw)
            n = self.calls
            self.calls += 1
            hit = self.at <= n < self.at + self.times
            if hit and not self.after:
                self._fire(n)
            out = fn(*a, **kw)
            if hit:
                self._fire(n)
            return out

        return wrapped

    def _fire(self, n: int) -> None:
        self.fired += 1
        if self._plan is not None:
            self.affected |= {r.request_id for r in self._plan.requests}
        raise InjectedFault(f"injected fault at {self.point} call {n}")
