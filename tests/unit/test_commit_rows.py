"""The DFlash lane's batched commit (DFlashLane.commit_rows, what a decode step of speculating requests calls):
it leaves exactly the state commit_context item by item leaves (pending rows, their order and values, host
bytes), drops the staged rows it commits, hands every row through append_pending_context (the seam
tests/adapter.FeatureRecorder wraps), and a bad item raises the same AlignmentError as commit_context, with
the items before it committed.

Run: pytest tests/unit/test_commit_rows.py
"""

from __future__ import annotations

import pytest
import torch

from refengine.errors import AlignmentError
from tests.adapter import cpu_engine


def _lane(pair):
    lane = cpu_engine(pair.target, pair.draft, max_num_seqs=4).proposer
    for r in range(3):
        lane.start_request(r, 64)
    return lane


def _stage(lane, step: int) -> list[tuple[int, int, int]]:
    """Each of requests 0..2 stages rows at its context's end (2 rows for request 1, 1 otherwise); returns
    the commits of one row each (request 1's second row dropped, as a step's rejected rows are)."""
    commits = []
    for r in range(3):
        pos = lane.context_rows(r)
        rows = 2 if r == 1 else 1
        feats = torch.full((rows, lane._width), float(100 * step + 10 * r)) + torch.arange(rows)[:, None]
        lane.stage_features(r, pos, feats)
        commits.append((r, pos, 1))
    return commits


def _state(lane):
    return {
        r: (c.length, c.pending_rows, c.host_bytes, torch.cat(c.pending) if c.pending else None)
        for r, c in lane._ctx.items()
    }


def test_commit_rows_equals_commit_context_item_by_item(trained_pair):
    one, many = _lane(trained_pair), _lane(trained_pair)
    for lane in (one, many):  # every row held "off the device" (a plain step's rows on the host)
        lane._off_device = lambda feats: True
    seen: list[tuple[int, int]] = []
    append = many.append_pending_context

    def recording_append(req_id, feats, first_position):
        seen.append((req_id, first_position))
        return append(req_id, feats, first_position)

    many.append_pending_context = recording_append
    for step in range(4):
        for r, pos, rows in _stage(one, step):
            one.commit_context(r, pos, rows)
        many.commit_rows(_stage(many, step))
        assert not one.staged_requests() and not many.staged_requests(), "committed rows stay staged"
    a, b = _state(one), _state(many)
    for r in a:
        assert a[r][:3] == b[r][:3], f"request {r}: (length, pending rows, host bytes) {a[r][:3]} vs {b[r][:3]}"
        delta = (a[r][3] - b[r][3]).abs().max().item()
        assert delta == 0.0, f"request {r}: pending rows differ, max delta {delta}"
    assert one._host_bytes == many._host_bytes == sum(v[2] for v in b.values()) > 0
    assert seen == [(r, p) for p in range(4) for r in range(3)], f"rows past the append seam: {seen}"


def test_commit_rows_raises_commit_contexts_error(trained_pair):
    lane = _lane(trained_pair)
    commits = _stage(lane, 0)
    commits[1] = (1, commits[1][1] + 1, 1)  # request 1 commits from the wrong position
    with pytest.raises(AlignmentError, match=r"request 1: commit of rows \[1, 2\)"):
        lane.commit_rows(commits)
    assert lane.context_rows(0) == 1 and lane.context_rows(2) == 0, "items before the bad one are committed"
    with pytest.raises(AlignmentError, match="request 2: 1 context rows committed but no features were staged"):
        lane.commit_rows([(2, 0, 1), (2, 0, 1)])
