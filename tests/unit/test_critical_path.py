"""The runner's `critical_s` timing: host time between reading results back (a sync) and queueing the next graph
replay, the time the device has nothing to run. Host work added after a step's read (a slower commit) counts
in full; host work between two launches of one step, with no sync between (after the draft graph is queued,
before the verify's), does not; eager steps launch no graph and count nothing. Also `bench_steps --device cpu`
(its critical ms column and the drafter's own floor on DFlash rows; --profile refused off CUDA).

Run: python -m pytest tests/unit/test_critical_path.py -q
"""

from __future__ import annotations

import json
import time

import pytest

from refengine.config import EngineConfig
from refengine.defaults import RANDOM_PAIR
from refengine.engine import Engine
from refengine.request import SamplingParams
from refengine.runner.draft_handoff import VerifyClock
from refengine.scheduler.scheduler import Scheduler

DELAY_S = 0.02
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def _critical_per_step(monkeypatch, graph_mode: str, delay_in: str | None) -> tuple[float, int]:
    """(critical_s, steps after the prefill) of a DFlash engine generating PROMPTS, with DELAY_S added to
    `delay_in`: 'commit' (after each step's read) or 'drafted' (between the draft's and the verify's launch)."""
    if delay_in == "commit":
        commit = Scheduler.commit

        def slow_commit(self, plan, result):
            time.sleep(DELAY_S)
            commit(self, plan, result)

        monkeypatch.setattr(Scheduler, "commit", slow_commit)
    elif delay_in == "drafted":
        drafted = VerifyClock.drafted

        def slow_drafted(self):
            time.sleep(DELAY_S)
            drafted(self)

        monkeypatch.setattr(VerifyClock, "drafted", slow_drafted)
    engine = Engine(
        EngineConfig(
            str(RANDOM_PAIR / "target"), draft_path=str(RANDOM_PAIR / "draft"), device="cpu", graph_mode=graph_mode
        )
    )
    engine.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    steps = sum(engine.scheduler.plan_counts.values()) - engine.scheduler.plan_counts["prefill"]
    monkeypatch.undo()
    return engine.runner.timings["critical_s"], steps


@pytest.mark.parametrize("graph_mode", ["full", "piecewise"])
def test_host_work_after_a_read_counts_and_work_between_launches_does_not(monkeypatch, graph_mode):
    base, steps = _critical_per_step(monkeypatch, graph_mode, None)
    assert steps > 2 and 0 < base < steps * DELAY_S, (base, steps)
    slow, steps_slow = _critical_per_step(monkeypatch, graph_mode, "commit")
    # every step after the first commits before the next launch (the last commit is followed by none)
    added = slow - base
    assert steps_slow == steps and added >= (steps - 1) * DELAY_S * 0.95, (
        f"a {DELAY_S * 1e3:.0f} ms slower commit added {added * 1e3:.1f} ms of critical time over {steps} steps"
    )
    between, _ = _critical_per_step(monkeypatch, graph_mode, "drafted")
    assert between - base < steps * DELAY_S * 0.5, (
        f"host work while the draft graph runs counted {(between - base) * 1e3:.1f} ms (base {base * 1e3:.1f})"
    )


def test_eager_steps_count_nothing(monkeypatch):
    critical, steps = _critical_per_step(monkeypatch, "eager", "commit")
    assert steps > 2 and critical == 0.0, critical


def test_bench_steps_on_the_cpu_reports_critical_ms_and_the_drafters_floor(capsys):
    from refengine.bench_steps import main

    pair = ["--target", str(RANDOM_PAIR / "target"), "--draft", str(RANDOM_PAIR / "draft")]
    common = [*pair, "--device", "cpu", "--batches", "1", "--steps", "3", "--warmup", "1", "--prompt-len", "8"]
    assert main([*common, "--modes", "full"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert {r["kind"] for r in rows} == {"plain", "dflash"}
    for r in rows:
        assert r["fused_ops"] == "none" and 0 < r["critical_ms"] <= r["host_ms"] <= r["ms_per_step"] + 1e-6, r
    plain, dflash = (next(r for r in rows if r["kind"] == k) for k in ("plain", "dflash"))
    assert "draft_floor_ms" not in plain, plain
    # the drafter's own floor: fewer bytes than the target's, and the ratio is that floor over the draft's ms
    assert 0 < dflash["draft_floor_ms"] < dflash["floor_ms"], dflash
    want = dflash["draft_floor_ms"] / dflash["draft_ms"]
    assert abs(dflash["draft_floor_ratio"] - want) <= 2e-3 * max(1.0, want), (dflash["draft_floor_ratio"], want)
    with pytest.raises(SystemExit):
        main([*common, "--modes", "full", "--profile"])
    assert "--profile reads the GPU's idle time: it needs --device cuda" in capsys.readouterr().err
