"""The adaptive policy's cost samples: each decode / verify step's shape and the runner's synchronised times.

A sample is taken at the step's commit and handed to the policy later: while the next step's graph runs (the
runner's `while_waiting` hook, between that graph's launch and the step's one host sync, where the host only
waits), after the next step's `execute` when it has no graph (a prefill, eager), or at once when the engine
goes idle. So the policy chooses each step with the samples of the steps before the last (the moving averages
do not notice the lag). Handing one over updates the cost fits and tables: ~9 us a step on the 2-core dev CPU;
taking and feeding together cost 18 us a step at c1 on the H200's host, taking alone 8 us (docs/PERF.md, runs
48 and 51), so a plain stretch's steps are sampled once in STRETCH_SAMPLE, their mean counted as that many
steps. A sample whose steps captured a CUDA graph is dropped: its time is the capture's.

With CostModel.price_host, each step's host time (its wall time in Engine.step less the runner's synchronised
work: the choice, the commit) is summed by kind of step (a speculating one, a plain one) and handed over with
the cost samples, as the mean of the steps since: the policy prices it (step_costs.H_verify / H_plain). Off,
only verify steps are timed, from their choice (choice_started): a large batch's plain-regime test prices
H_verify (CostModel.host_s); timing every step cost ~5 us a step on the dev CPU, ~1% of a plain step of the
trained tiny pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from refengine.plan import DecodePlan, VerifyPlan
from refengine.spec_decode.adaptive import AdaptivePolicy

TIMINGS = ("draft_s", "verify_s", "decode_s", "catch_up_s")  # the runner's timings a sample reads
BUSY = ("draft_s", "verify_s", "decode_s", "shadow_s")  # the runner's synchronised work of a decode / verify step


class CostSamples:
    def __init__(self, policy: AdaptivePolicy):
        self.policy = policy
        self._timings: dict[str, float] | None = None
        self._seen: tuple[float, ...] = (0.0,) * len(TIMINGS)  # the timings at the last sample
        self._captures: Callable[[], int] | None = None
        self._captured = 0  # graphs captured as of the current plan
        self._pending: list[tuple] = []  # samples taken since the last feed (one, or a stretch's last two)
        self._decodes = 0  # decode steps since the last sample (a plain stretch samples every few)
        self._step_at = (0.0, 0.0)  # the current step's start: (perf_counter, the runner's busy seconds)
        self._host = {"verify": [0.0, 0.0, 0], "plain": [0.0, 0.0, 0]}  # kind -> [seconds, requests, steps]

    def bind(self, timings: dict[str, float], captures: Callable[[], int] | None) -> None:
        """The runner's cumulative synchronised timings, and its count of graphs captured so far."""
        self._timings = timings
        self._seen = tuple(timings.get(k, 0.0) for k in TIMINGS)
        self._captures = captures

    def _count(self) -> int:
        return self._captures() if self._captures is not None else 0

    def _busy(self) -> float:
        t = self._timings
        return sum(map(t.__getitem__, BUSY)) if t is not None else 0.0

    def step_started(self) -> None:
        """Engine.step begins (before the schedule): its host time is counted from here."""
        self._step_at = (time.perf_counter(), self._busy())

    def choice_started(self) -> None:
        """The scheduler asks the policy for a step's spans: without price_host, a verify step's host time is
        counted from here (Engine.step hands its end only for verify plans), so the plain-regime test can price
        H_verify (CostModel.host_s) while a dormant wave's steps, which ask nothing, pay nothing for it."""
        if not self.policy.cost.price_host:
            self.step_started()

    def step_ended(self, plan: VerifyPlan | DecodePlan) -> None:
        """The step of `plan` committed: its wall time since step_started less the runner's synchronised work
        is the host's, summed for its kind (a verify plan: "verify"; a decode plan: "plain")."""
        if self._timings is None:
            return
        t0, busy0 = self._step_at
        host = time.perf_counter() - t0 - (self._busy() - busy0)
        acc = self._host["verify" if isinstance(plan, VerifyPlan) else "plain"]
        acc[0] += max(host, 0.0)
        acc[1] += len(plan.requests)
        acc[2] += 1

    def mark_plan(self) -> None:
        """A plan is made: the graphs captured so far (a step that captures one is no sample)."""
        self._captured = self._count()

    def take(self, plan: VerifyPlan | DecodePlan, every: int = 1) -> None:
        """The committed step's sample: its shape, its draft / verify (or, all spans 1, decode) time, and the
        context rows its own choice carried (its catch-up; the policy's next choice replaces them).
        `every` (the decode steps of one plain stretch, all of one shape): one sample in that many, their mean
        time counted as that many steps (taking one cost ~8 us of the H200's host time at c1, run 51); the
        stretch's last ones are sampled by flush_decodes when it closes."""
        if self._timings is None:
            return
        if isinstance(plan, DecodePlan):
            self._decodes += 1
            if self._decodes < every:
                return
        self._sample(plan, len(plan.requests))

    def flush_decodes(self, n: int) -> None:
        """A closing plain stretch of n requests: sample its decode steps not sampled yet (none: a no-op)."""
        if self._timings is not None and self._decodes:
            self._sample(None, n)

    def _sample(self, plan: VerifyPlan | DecodePlan | None, n: int) -> None:
        """The timings since the last sample: a verify `plan`'s, or (a DecodePlan or None) the mean of the
        decode steps since (a verify's window may hold decode steps too: their time is not read)."""
        assert self._timings is not None
        steps, self._decodes = max(self._decodes, 1), 0
        now = tuple(self._timings.get(k, 0.0) for k in TIMINGS)
        draft_s, verify_s, decode_s, catch_up_s = (a - b for a, b in zip(now, self._seen))
        self._seen = now
        captured = self._count()
        # the count is also the next plan's: a plain stretch's plans do not mark theirs
        captured_now, self._captured = captured != self._captured, captured
        if captured_now:
            return
        if not isinstance(plan, VerifyPlan):
            self._pending.append((n, n, 0, 0.0, decode_s / steps, 0.0, 0, steps, 0))
        else:
            spans = plan.spans
            drafted = sum(s > 1 for s in spans)
            sample = (n, sum(spans), drafted, draft_s, verify_s, catch_up_s, self.policy.carried_rows, 1, max(spans))
            self._pending.append(sample)

    def feed(self) -> None:
        """Hand the pending samples (if any) to the policy."""
        if self._pending:
            samples, self._pending = self._pending, []
            for n, rows, drafted, draft_s, verify_s, catch_up_s, carried, steps, widest in samples:
                self.policy.observe_step(n, rows, drafted, draft_s, verify_s, catch_up_s, carried, steps, widest)
            for kind, acc in self._host.items():  # (at the samples' rate: a plain stretch's one in a few)
                if acc[2]:
                    self.policy.cost.observe_host(kind, acc[1] / acc[2], acc[0] / acc[2])
                    acc[:] = [0.0, 0.0, 0]
