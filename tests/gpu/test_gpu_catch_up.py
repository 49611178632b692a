"""The lane's catch-up flush on the graph path (CUDA, marked `gpu`): after a stretch of span-1 steps, the first
draft projects the stretch's pending context rows before its graph (catch-up graphs); that time is recorded
apart (runner.timings["catch_up_s"]) and left out of the draft time the span policy's report carries, while
steady drafts (at most B pending rows, projected inside the draft graph) record none.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_catch_up.py
"""

from __future__ import annotations

import pytest

from refengine import SamplingParams
from tests.adapter import gpu_engine
from tests.span_policies import ScriptedSpans

pytestmark = pytest.mark.gpu
B = 16


def test_gpu_catch_up_after_a_plain_stretch_is_timed_apart(trained_pair):
    policy = ScriptedSpans(B, lambda step, ids, rem: [1] * len(ids) if step < 40 else [B] * len(ids))
    engine = gpu_engine(trained_pair.target, trained_pair.draft, graph_mode="full", span_policy=policy)
    engine.capture_graphs()  # a step that captures a graph is no cost sample: capture them all first
    runner = engine.runner
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
    reports = [rep for rep in policy.reports if max(rep.spans) > 1]
    first = reports[0]
    assert first.draft_seconds is not None and abs(first.draft_seconds - (first_draft - first_catch_up)) < 1e-9, (
        first.draft_seconds,
        first_draft,
        first_catch_up,
    )
