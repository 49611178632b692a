"""Shadow probes on CUDA (refengine/runner/shadow_drafts.py; bf16, FlashInfer fa2; marked `gpu`): a plain
choice's probes draft on a second stream beside the decode graph (the drafter's graphs in a memory pool and
FlashInfer workspace of their own). With the trained tiny pair in piecewise and full graph modes: outputs equal
plain decoding, no probe runs a verify, each answer is the longest prefix of its drafts the output matches,
the drafts really went through the side stream, and a shadow drafts and measures what fixed DFlash's first
verify does. The CPU versions: tests/golden/test_lossless_shadow.py.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_shadow_probe.py
"""

from __future__ import annotations

import pytest

from tests.adapter import gpu_engine
from tests.golden.test_lossless_shadow import run_shadow_lossless, run_shadow_vs_verify

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_gpu_shadow_probes_are_lossless_on_the_side_stream(trained_pair, mode, monkeypatch):
    from refengine.runner.shadow_drafts import ShadowDrafts

    launch, side = ShadowDrafts.launch, []

    def launch_counted(self, proposer, items):
        launch(self, proposer, items)
        side.append(self._pending is not None)  # queued on the side stream (not drafted after the decode)

    monkeypatch.setattr(ShadowDrafts, "launch", launch_counted)
    run_shadow_lossless(trained_pair, mode, gpu_engine)
    assert side and all(side), f"shadow drafts on the side stream: {side.count(True)} of {len(side)}"


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_gpu_shadow_probe_measures_what_a_verify_accepts(trained_pair, mode):
    found = run_shadow_vs_verify(trained_pair, mode, gpu_engine)
    assert max(found) > 0, found
