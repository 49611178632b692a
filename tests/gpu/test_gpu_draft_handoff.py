"""The draft-to-verify hand-off on CUDA (refengine/runner/draft_handoff.py; bf16, FlashInfer fa2; marked `gpu`):
with fixed spans, the hand-off (drafts left on the device, swapped into the verify graph's ids) and the host
path (drafts read back before the verify) run the same graphs on the same inputs, so every verify step's
drafts, every request's committed lengths and the outputs must be identical, and the hand-off must have run.
The CPU version, with the same prompts and budgets: tests/unit/test_draft_handoff.py.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_draft_handoff.py
"""

from __future__ import annotations

import pytest

from tests.adapter import gpu_engine
from tests.unit.test_draft_handoff import assert_steps_equal, run_handoff

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_gpu_handoff_equals_the_host_path(trained_pair, mode, monkeypatch):
    def run(host: bool):
        engine = gpu_engine(trained_pair.target, trained_pair.draft, graph_mode=mode, max_num_seqs=4)
        return run_handoff(engine, host, monkeypatch)

    out, stats, commits, launches = run(False)
    h_out, h_stats, h_commits, h_launches = run(True)
    assert launches > 0 and h_launches == 0, f"hand-off launches {launches}, host path {h_launches}"
    assert_steps_equal(stats, commits, h_stats, h_commits)
    assert out == h_out
