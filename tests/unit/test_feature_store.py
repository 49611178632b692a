"""The feature store (refengine/spec_decode/feature_store.py): target features by KV slot.

Checks that rows written for a request's positions read back as that request's rows when the requests'
pages interleave in the pool; that a wrong shape, or a lane bound to a store of the wrong width, raises
AlignmentError naming the numbers; that the lane refuses to project rows with no store bound; and that an
engine's forwards write the store (a prefill's rows equal the target's own tap features).

Run: pytest tests/unit/test_feature_store.py
"""

from __future__ import annotations

import pytest
import torch

from refengine import SamplingParams
from refengine.attention.base import AttnBatch
from refengine.errors import AlignmentError
from refengine.kv.pool import KvPool
from refengine.spec_decode.feature_store import FeatureStore
from refengine.spec_decode.lane import DFlashLane
from tests.adapter import cpu_engine

WIDTH = 6


def _store(page: int = 4) -> FeatureStore:
    pool = KvPool(1, 16, page, 1, 8, torch.float32, torch.device("cpu"), dummy_blocks=1)
    return FeatureStore(pool, WIDTH, torch.float32, torch.device("cpu"))


def test_rows_read_back_by_request_and_position_across_interleaved_pages():
    store = _store()
    pool = store.pool
    for r in (0, 1):
        pool.admit(r, 20)
    for _ in range(3):  # pages interleave: 0, 1, 0, 1, ...
        for r in (0, 1):
            pool.extend(r, 4)
    feats = {r: torch.arange(12 * WIDTH, dtype=torch.float32).view(12, WIDTH) + 1000 * r for r in (0, 1)}
    for r in (0, 1):
        store.put(r, 0, feats[r][:5])
        store.put(r, 5, feats[r][5:])
    for r in (0, 1):
        got = store.read(r, 3, 11)
        delta = (got - feats[r][3:11]).abs().max().item()
        assert delta == 0.0, f"request {r}: rows 3..10 read back with max |delta| {delta}"
    assert store.rows.shape == ((16 + 1) * 4, WIDTH), "a row per slot, the dummy page's included"


def test_wrong_shapes_raise():
    store = _store()
    store.pool.admit(0, 8)
    store.pool.extend(0, 8)
    with pytest.raises(AlignmentError, match=rf"features \[3, 5\] for 3 slots, expected rows of {WIDTH}"):
        store.put(0, 0, torch.zeros(3, 5))
    with pytest.raises(AlignmentError, match=r"features \[2, 6\] for 3 slots"):
        store.write(store.slots(0, 0, 3), torch.zeros(2, WIDTH))


def test_lane_checks_its_store(trained_pair):
    engine = cpu_engine(trained_pair.target, trained_pair.draft)
    lane = engine.proposer
    assert isinstance(lane, DFlashLane) and lane.store is engine.store
    with pytest.raises(AlignmentError, match=rf"feature store rows of {WIDTH}, the drafter reads"):
        lane.bind_feature_store(_store())
    bare = DFlashLane(lane.drafter, lane.pool, lane.attention)
    bare.start_request(0, 8)
    bare.append_pending_context(0, 0, 2)
    with pytest.raises(AlignmentError, match="no feature store"):
        bare._flush_pending([0])


def test_a_prefill_writes_the_targets_tap_features(trained_pair):
    engine = cpu_engine(trained_pair.target, trained_pair.draft)
    prompt = [5, 17, 29, 41, 53, 65, 77]
    req = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill
    got = engine.store.read(req.request_id, 0, len(prompt))
    # the same forward once more (rewriting the same K/V at the same slots): its taps are what the store holds
    pool, rid = engine.pool, req.request_id
    batch = AttnBatch(
        q_lens=[len(prompt)],
        kv_lens=[len(prompt)],
        block_tables=[pool.table(rid)],
        slots=pool.slots(rid, 0, len(prompt)),
        positions=torch.arange(len(prompt)),
    )
    taps = engine.proposer.capture_layers
    _, want = engine.target.forward(torch.tensor(prompt), batch, pool, engine.runner.attention, taps)
    delta = (got - want).abs().max().item()
    assert delta < 1e-5, f"prefill rows in the store differ from the target's taps: max |delta| {delta:.3e}"
