"""The DFlash lane's decode-step commit (stage_step + commit_step, what a plain decode step of speculating
requests uses in adaptive mode): one call stages the step's rows, one commits them; the features themselves
are already in the feature store (the decode graph wrote them at the rows' KV slots). Checks that
- it leaves exactly the state stage_features + commit_context request by request leaves (context rows, and
  the drafter's context K/V once projected);
- every row passes the append_pending_step seam (what tests/adapter.FeatureRecorder wraps);
- a misaligned row or a wrong request list raises AlignmentError and commits nothing;
- staged_requests / discard_staged / release see the staged step.

Run: pytest tests/unit/test_commit_step.py
"""

from __future__ import annotations

import pytest
import torch

from refengine.errors import AlignmentError
from tests.adapter import cpu_engine

REQS = [0, 1, 2]
STEPS = 4


def _lane(pair):
    engine = cpu_engine(pair.target, pair.draft, max_num_seqs=4)
    lane = engine.proposer
    for r in REQS:
        lane.start_request(r, 64)
        engine.pool.admit(r, 64)
        engine.pool.extend(r, STEPS)  # the target KV slots the store's rows live at
    return lane


def _step(lane, step: int) -> list[int]:
    """Writes a decode step's features for REQS into the store (row i = 100 * step + 10 * i + the column
    index / 1000, at each context's end, as the decode graph would) and returns the rows' positions."""
    starts = [lane.context_rows(r) for r in REQS]
    width = lane.store.width
    for i, (r, p) in enumerate(zip(REQS, starts)):
        lane.store.put(r, p, torch.full((1, width), float(100 * step + 10 * i)) + torch.arange(width) * 1e-3)
    return starts


def _context_kv(lane, r: int) -> torch.Tensor:
    """Layer 0's context K of request r's committed rows, after projecting them."""
    lane._flush_pending([r])
    slots = lane.pool.slots(r, 0, lane.context_rows(r))
    return lane.pool.k[0].view(-1, *lane.pool.k[0].shape[2:])[slots]


def test_commit_step_equals_commit_context_request_by_request(trained_pair):
    one, many = _lane(trained_pair), _lane(trained_pair)
    seen: list[tuple[list[int], list[int]]] = []
    append_step = many.append_pending_step

    def recording(req_ids, starts):
        seen.append((list(req_ids), list(starts)))
        return append_step(req_ids, starts)

    many.append_pending_step = recording
    for step in range(STEPS):
        starts = _step(one, step)
        assert _step(many, step) == starts
        for i, r in enumerate(REQS):
            one.stage_features(r, starts[i], 1)
            one.commit_context(r, starts[i], 1)
        many.stage_step(REQS, starts)
        assert many.staged_requests() == set(REQS)
        many.commit_step(REQS)
        assert not one.staged_requests() and not many.staged_requests(), "committed rows stay staged"
    for r in REQS:
        assert one.context_rows(r) == many.context_rows(r) == STEPS
        assert many._ctx[r].pending_rows == STEPS, "a committed decode row was projected at once"
        a, b = _context_kv(one, r), _context_kv(many, r)
        delta = (a - b).abs().max().item()
        assert a.abs().max() > 0 and delta == 0.0, f"request {r}: context K differs, max delta {delta}"
    assert seen == [(REQS, [p] * 3) for p in range(STEPS)], f"steps past the append seam: {seen}"


def test_a_bad_step_raises_and_commits_nothing(trained_pair):
    lane = _lane(trained_pair)
    starts = _step(lane, 0)
    bad = [0, 5, 0]  # request 1's row at the wrong position
    lane.stage_step(REQS, bad)
    with pytest.raises(AlignmentError, match=r"request 1: a decode row at position 5, but the drafter context ends"):
        lane.commit_step(REQS)
    assert [lane.context_rows(r) for r in REQS] == [0, 0, 0], "a failed step commits no request's row"
    assert not lane.staged_requests()
    lane.stage_step(REQS, starts)
    with pytest.raises(AlignmentError, match=r"requests \[0, 1\] committed, but staged were \[0, 1, 2\]"):
        lane.commit_step([0, 1])
    with pytest.raises(AlignmentError, match=r"requests \[9\]: features staged for requests with no drafter context"):
        lane.stage_step([0, 9], [0, 0])


def test_staged_step_is_seen_discarded_and_released(trained_pair):
    lane = _lane(trained_pair)
    starts = _step(lane, 0)
    lane.stage_features(0, 0, 1)
    lane.stage_step([1, 2], starts[1:])
    assert lane.staged_requests() == {0, 1, 2}
    lane.discard_staged()
    assert lane.staged_requests() == set()
    lane.stage_step([1, 2], starts[1:])
    lane.release(2)  # a step is committed whole or not at all: releasing one of its requests drops it
    assert lane.staged_requests() == set()
    with pytest.raises(AlignmentError, match=r"committed, but staged were \[\]"):
        lane.commit_step([1, 2])
