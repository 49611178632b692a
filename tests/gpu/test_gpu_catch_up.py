"""The lane's catch-up flush on the graph path (CUDA, marked `gpu`): after a plain stretch of an adaptive
engine, the first draft projects the stretch's pending context rows before its graph (catch-up graphs); that time is
recorded apart (runner.timings["catch_up_s"]) and handed to the adaptive policy apart from the draft time, while
steady drafts (at most B pending rows, projected inside the draft graph) record none.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_catch_up.py
"""

from __future__ import annotations

import pytest

from refengine import SamplingParams
from tests.adapter import gpu_engine, record_draft_costs

pytestmark = pytest.mark.gpu
B = 16


def test_gpu_catch_up_after_a_plain_stretch_is_timed_apart(trained_pair):
    engine = gpu_engine(trained_pair.target, trained_pair.draft, graph_mode="full", speculation="adaptive")
    engine.capture_graphs()  # a step that captures a graph is no cost sample: capture them all first
    policy, runner = engine.scheduler.policy, engine.runner
    assert policy is not None
    step = {"n": 0}

    def choose(ids, remaining):
        step["n"] += 1
        return [1] * len(ids) if step["n"] <= 40 else [B] * len(ids)  # 40 plain steps, then drafts

    policy.choose = choose  # type: ignore[method-assign]
    samples = record_draft_costs(engine)
    engine.add_request(list(range(5, 69)), SamplingParams(max_tokens=40 + 6 * B, ignore_eos=True))
    per_step = []
    while engine.has_work():
        before = (runner.timings["draft_s"], runner.timings["catch_up_s"])
        engine.step()
        per_step.append((runner.timings["draft_s"] - before[0], runner.timings["catch_up_s"] - before[1]))
    drafting = [(d, c) for d, c in per_step if d > 0]
    assert len(drafting) >= 3, per_step
    (first_draft, first_catch_up), *steady = drafting
    assert first_catch_up > 0, f"the draft after 40 plain steps recorded no catch-up: {drafting[:3]}"
    assert all(c == 0 for _, c in steady), f"steady drafts recorded catch-up: {steady}"
    assert samples and samples[0] == (first_draft, first_catch_up), (samples[0], first_draft, first_catch_up)
