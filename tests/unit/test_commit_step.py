"""The DFlash lane's decode-step commit (stage_step + commit_step, what a plain decode step of speculating
requests uses in adaptive mode): one staged tensor for the whole step, one call to commit it. Checks that
- it leaves exactly the state stage_features + commit_context request by request leaves (context rows,
  host bytes, and the pending rows' values in order once projected), with no per-request tensor queued;
- every row passes the append_pending_step seam (what tests/adapter.FeatureRecorder wraps);
- a misaligned row, a wrong request list or a wrong width raises AlignmentError and commits nothing;
- staged_requests / discard_staged / release see the staged step.

Run: pytest tests/unit/test_commit_step.py
"""

from __future__ import annotations

import pytest
import torch

from refengine.errors import AlignmentError
from refengine.spec_decode.pending_rows import DecodeRow, on_device
from tests.adapter import cpu_engine

REQS = [0, 1, 2]


def _lane(pair):
    lane = cpu_engine(pair.target, pair.draft, max_num_seqs=4).proposer
    for r in REQS:
        lane.start_request(r, 64)
    lane._off_device = lambda feats: True  # every row held "off the device" (a plain step's rows on the host)
    return lane


def _step(lane, step: int) -> tuple[list[int], torch.Tensor]:
    """A decode step's features for REQS: row i = 100 * step + 10 * i (+ the column index), at each context's end."""
    feats = torch.full((len(REQS), lane._width), float(100 * step))
    feats += 10 * torch.arange(len(REQS))[:, None] + torch.arange(lane._width)[None, :] * 1e-3
    return [lane.context_rows(r) for r in REQS], feats


def _pending(lane, r: int) -> torch.Tensor:
    return on_device(lane._ctx[r].pending, torch.device("cpu"))


def test_commit_step_equals_commit_context_request_by_request(trained_pair):
    one, many = _lane(trained_pair), _lane(trained_pair)
    seen: list[tuple[list[int], list[int]]] = []
    append_step = many.append_pending_step

    def recording(req_ids, starts, feats):
        seen.append((list(req_ids), list(starts)))
        return append_step(req_ids, starts, feats)

    many.append_pending_step = recording
    for step in range(4):
        starts, feats = _step(one, step)
        for i, r in enumerate(REQS):
            one.stage_features(r, starts[i], feats[i : i + 1])
            one.commit_context(r, starts[i], 1)
        many.stage_step(REQS, starts, feats.clone())
        assert many.staged_requests() == set(REQS)
        many.commit_step(REQS)
        assert not one.staged_requests() and not many.staged_requests(), "committed rows stay staged"
    for r in REQS:
        assert one.context_rows(r) == many.context_rows(r) == 4
        assert one._ctx[r].host_bytes == many._ctx[r].host_bytes > 0, f"request {r}: host bytes"
        assert all(isinstance(p, DecodeRow) for p in many._ctx[r].pending), "a decode row is queued as a view"
        delta = (_pending(one, r) - _pending(many, r)).abs().max().item()
        assert delta == 0.0, f"request {r}: pending rows differ, max delta {delta}"
    assert one._host_bytes == many._host_bytes == sum(c.host_bytes for c in many._ctx.values())
    assert seen == [(REQS, [p] * 3) for p in range(4)], f"steps past the append seam: {seen}"


def test_a_bad_step_raises_and_commits_nothing(trained_pair):
    lane = _lane(trained_pair)
    starts, feats = _step(lane, 0)
    bad = [0, 5, 0]  # request 1's row at the wrong position
    lane.stage_step(REQS, bad, feats)
    with pytest.raises(AlignmentError, match=r"request 1: a decode row at position 5, but the drafter context ends"):
        lane.commit_step(REQS)
    assert [lane.context_rows(r) for r in REQS] == [0, 0, 0], "a failed step commits no request's row"
    assert lane._host_bytes == 0 and not lane.staged_requests()
    lane.stage_step(REQS, starts, feats)
    with pytest.raises(AlignmentError, match=r"requests \[0, 1\] committed, but staged were \[0, 1, 2\]"):
        lane.commit_step([0, 1])
    with pytest.raises(AlignmentError, match=r"decode step features \[3, 5\] for 3 requests"):
        lane.append_pending_step(REQS, starts, feats[:, :5])
    with pytest.raises(AlignmentError, match=r"requests \[9\]: features staged for requests with no drafter context"):
        lane.stage_step([0, 9], [0, 0], feats[:2])


def test_staged_step_is_seen_discarded_and_released(trained_pair):
    lane = _lane(trained_pair)
    starts, feats = _step(lane, 0)
    lane.stage_features(0, 0, feats[:1])
    lane.stage_step([1, 2], starts[1:], feats[1:])
    assert lane.staged_requests() == {0, 1, 2}
    lane.discard_staged()
    assert lane.staged_requests() == set()
    lane.stage_step([1, 2], starts[1:], feats[1:])
    lane.release(2)  # a step is committed whole or not at all: releasing one of its requests drops it
    assert lane.staged_requests() == set()
    with pytest.raises(AlignmentError, match=r"committed, but staged were \[\]"):
        lane.commit_step([1, 2])
