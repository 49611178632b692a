"""Pending drafter context rows held off the device (refengine/spec_decode/pending_rows.py): plain decode
steps' features wait on the host, and past HOST_PENDING_BYTES per lane they move to the device in order.

On the CPU every tensor is on the lane's device, so the test marks plain decode steps' tensors (stage_step)
as held off the device and sets a small bound. Then, over an adaptive run that mostly decodes plainly
and drafts now and then:
- the host bytes never pass the bound and equal the per-request sums;
- the rows are moved several times;
- the drafts are exactly those of the same run without the bound (on the CPU nothing really moves: the
  order of moved runs is checked with the "meta" device, the real move by the GPU test
  `test_gpu_decode_features_on_the_host_give_the_same_drafts`);
- the output equals eager greedy;
- a step tensor whose rows are mostly wanted by one flush moves to the device whole, once, and is sliced
  there (the values and order checked on the CPU, with every part marked off the device).

Run: pytest tests/unit/test_pending_rows.py
"""

from __future__ import annotations

import random

import torch

import refengine.spec_decode.lane as lane_module
from refengine.spec_decode.pending_rows import DecodeRow, on_device, runs_to_device
from tests.adapter import assert_same_tokens, cpu_engine, first_divergence, greedy, record_drafts

B = 16


def test_runs_to_device_keeps_order_and_device_parts():
    a, b, c = (torch.full((n, 3), float(n)) for n in (1, 2, 3))
    cpu = torch.device("cpu")
    assert [t.shape[0] for t in runs_to_device([a, b, c], cpu)] == [1, 2, 3], "parts already on the device stay"
    assert torch.equal(on_device([a, b, c], cpu), torch.cat([a, b, c]))
    # mixed devices ("meta" stands in for the accelerator): each run of host parts becomes one moved tensor,
    # parts already there stay as they are, in order
    meta = torch.device("meta")
    d = torch.zeros(4, 3)
    mixed = [a, torch.zeros(2, 3, device=meta), c, d]
    out = runs_to_device(mixed, meta)
    assert [(t.shape[0], t.device.type) for t in out] == [(1, "meta"), (2, "meta"), (7, "meta")], out
    assert out[1] is mixed[1], "a part already on the device is kept, not copied"
    assert on_device(mixed, meta).shape == (10, 3)


def test_step_tensors_mostly_wanted_move_whole_and_once():
    # three decode steps of 8 requests: each step's features one [8, 3] tensor (the runner's pinned copy), a
    # request's row of it a DecodeRow. Requests 0..5 catch up together: 6 of 8 rows of every step tensor are
    # wanted, so each moves once (in `moved`) and is sliced; a lone row of another step tensor rides in a
    # concatenated run instead, after a part of consecutive rows (a verify's).
    steps = [torch.arange(24, dtype=torch.float32).view(8, 3) + 100 * k for k in range(3)]
    rows = {r: [DecodeRow(s, r) for s in steps] for r in range(8)}
    lone_step = torch.arange(24, dtype=torch.float32).view(8, 3) + 1000
    lone = DecodeRow(lone_step, 1)  # 1 of 8 rows wanted: below min_share
    small = torch.arange(6, dtype=torch.float32).view(2, 3) + 2000  # a 2-request step: below MIN_STEP_ROWS
    verify = torch.full((2, 3), 3000.0)
    cpu, moved = torch.device("cpu"), {}
    parts = [f for r in range(6) for f in rows[r]] + [verify, lone, DecodeRow(small, 0), DecodeRow(small, 1)]
    want = torch.cat([p.step[p.row : p.row + 1] if isinstance(p, DecodeRow) else p for p in parts])
    out = runs_to_device(parts, cpu, moved, off=lambda t: True)  # every part counts as off the device
    assert torch.equal(torch.cat(out), want), "rows must come out in order, with their values"
    assert set(moved) == {id(s) for s in steps}, "each mostly-wanted step tensor moves whole, once"
    assert id(lone_step) not in moved, "a step tensor with less than half its rows wanted is not moved whole"
    assert id(small) not in moved, "a step tensor of fewer than MIN_STEP_ROWS rows is not moved whole"
    assert len(out) == 6 * 3 + 1, "verify rows, the lone row and the small step's rows go as one run"
    # a later call of the same flush reuses the moved tensors, even for a single row
    again = runs_to_device(rows[7], cpu, moved, off=lambda t: True)
    assert all(a.data_ptr() == moved[id(s)][7:].data_ptr() for a, s in zip(again, steps))
    # where the rows stay pending (min_share 1.0) a step tensor moves whole only if every row is wanted
    kept: dict = {}
    runs_to_device(parts, cpu, kept, off=lambda t: True, min_share=1.0)
    assert kept == {}, "6 of 8 rows wanted: no whole move when the rows stay pending"


def _run(pair, bound_rows: int | None, monkeypatch):
    engine = cpu_engine(pair.target, pair.draft, graph_mode="full", max_num_seqs=4, speculation="adaptive")
    lane = engine.proposer
    row_bytes = lane._width * 4  # fp32 on the CPU
    if bound_rows is not None:
        monkeypatch.setattr(lane_module, "HOST_PENDING_BYTES", bound_rows * row_bytes)
    decode_steps: dict[int, torch.Tensor] = {}  # id -> a plain decode step's features (kept alive: ids stay unique)
    stage_step = lane.stage_step

    def staging(req_ids, starts, feats):
        decode_steps[id(feats)] = feats
        return stage_step(req_ids, starts, feats)

    lane.stage_step = staging
    lane._off_device = lambda feats: id(feats) in decode_steps  # a plain decode step's rows: held "on the host"
    rng = random.Random(7)
    engine.scheduler.policy.choose = lambda ids, rem: [1] * len(ids) if rng.random() < 0.8 else [B] * len(ids)
    drafts = record_drafts(engine)
    step = engine.step

    def checked_step():
        done = step()
        held = sum(c.host_bytes for c in lane._ctx.values())
        assert lane._host_bytes == held, f"host bytes {lane._host_bytes} != per-request sum {held}"
        if bound_rows is not None:
            assert held <= bound_rows * row_bytes, f"{held // row_bytes} host rows held, bound {bound_rows}"
        return done

    engine.step = checked_step
    prompts = [[rng.randrange(200) for _ in range(n)] for n in (5, 17, 30, 9)]
    out = greedy(engine, prompts, [60, 45, 70, 50])
    engine.check_integrity()
    return engine, out, drafts, prompts


def test_host_rows_are_bounded_moved_in_order_and_lossless(trained_pair, monkeypatch):
    free_engine, free_out, free_drafts, prompts = _run(trained_pair, None, monkeypatch)
    engine, out, drafts, _ = _run(trained_pair, 12, monkeypatch)
    assert free_engine.proposer.host_moves == 0
    assert engine.proposer.host_moves >= 3, f"rows moved {engine.proposer.host_moves} times"
    assert len(drafts) == len(free_drafts) > 3, f"{len(drafts)} vs {len(free_drafts)} draft steps"
    first = first_divergence(drafts, free_drafts)
    assert first is None, f"drafts differ at draft step {first} of {len(drafts)} / {len(free_drafts)}"
    eager = cpu_engine(trained_pair.target, graph_mode="eager", max_num_seqs=4)
    want = greedy(eager, prompts, [60, 45, 70, 50])
    for i, (got, w) in enumerate(zip(out, want)):
        assert_same_tokens(got, w, f"request {i}")
