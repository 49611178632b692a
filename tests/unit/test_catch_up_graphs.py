"""The lane's catch-up projection as graphs (refengine/runner/catch_up_graphs.py), on the CPU (the fake
capturer replays by calling the function again, so the padding, chunking and buffer logic all run):
- the context K/V it writes equal the eager projection's (the drafter's context_kv) at every projected row,
  for catch-ups below, at and above the largest captured size (chunked), with several requests per chunk;
- padding rows write only the drafter pool's dummy page: every other slot is untouched;
- the captures are counted with the engine's graphs (a step that captures one is no cost sample);
- malformed sizes (or more rows than the memory reservation bills) and an oversized chunk raise ValueError.

Run: python -m pytest tests/unit/test_catch_up_graphs.py -q
"""

from __future__ import annotations

import pytest
import torch

from refengine.config import DRAFT_CONTEXT_FLUSH_ROWS
from refengine.runner.capture import Capturer
from refengine.runner.catch_up_graphs import CATCH_UP_ROWS, CatchUpGraphs
from tests.adapter import cpu_engine

REQS = [0, 1, 2]


def _lane(pair, rows: list[int], sizes: tuple[int, ...] | None):
    """A graph-mode CPU engine's lane whose requests carry `rows[i]` pending context rows each, with seeded
    features in the store; `sizes`: its catch-up graphs' row counts (None: the eager projection)."""
    engine = cpu_engine(pair.target, pair.draft, max_num_seqs=4, graph_mode="full")
    lane, draft = engine.proposer, engine.runner.draft_graphs
    if sizes is None:
        lane.executor = None
    else:
        draft.catch_up = CatchUpGraphs(
            draft.graph.stack, Capturer(torch.device("cpu")), engine.store.pool.dummy_slot, sizes
        )
    g = torch.Generator().manual_seed(0)
    for r, n in zip(REQS, rows):
        lane.start_request(r, 512)
        engine.pool.admit(r, 512)
        engine.pool.extend(r, n)
        lane.store.put(r, 0, torch.randn(n, lane.store.width, generator=g))
        lane.append_pending_context(r, 0, n)
    return engine, lane


def _pool_kv(lane) -> list[torch.Tensor]:
    return [t.clone() for t in (*lane.pool.k, *lane.pool.v)]


@pytest.mark.parametrize("rows", [[3, 5, 2], [16, 16, 16], [40, 7, 29]], ids=["below", "at", "chunked"])
def test_catch_up_graphs_write_what_the_eager_projection_writes(trained_pair, rows):
    sizes = (4, 16)  # small sizes: padding (3 -> 4), exact fits and chunks of 16 all occur
    _, eager = _lane(trained_pair, rows, None)
    engine, graphed = _lane(trained_pair, rows, sizes)
    before = _pool_kv(graphed)
    eager._flush_pending(REQS)
    graphed._flush_pending(REQS)
    page = graphed.pool.page_size
    dummy_page = {b * page + i for b in graphed.pool.dummy_blocks for i in range(page)}
    written = set()
    for r, n in zip(REQS, rows):
        assert graphed.context_rows(r) == eager.context_rows(r) == n and graphed._ctx[r].pending_rows == 0
        slots = graphed.pool.slots(r, 0, n)
        written.update(slots.tolist())
        for li, (a, b) in enumerate(zip((*eager.pool.k, *eager.pool.v), (*graphed.pool.k, *graphed.pool.v))):
            ea, gb = a.view(-1, *a.shape[2:])[slots], b.view(-1, *b.shape[2:])[slots]
            delta = (ea - gb).abs()
            assert ea.abs().max() > 0 and delta.max() < 1e-4, (
                f"request {r}, K/V tensor {li}: max delta {delta.max():.3g}, mean {delta.mean():.3g} at {n} rows"
            )
    for li, (old, new) in enumerate(zip(before, (*graphed.pool.k, *graphed.pool.v))):
        changed = set((old != new).view(old.shape[0] * old.shape[1], -1).any(-1).nonzero().flatten().tolist())
        stray = changed - written - dummy_page
        assert not stray, f"K/V tensor {li}: padding wrote slots {sorted(stray)[:8]} outside the dummy page"
    g = engine.runner.draft_graphs.catch_up
    chunks = -(-sum(rows) // 16)  # the flush fills chunks of the largest size across requests
    assert g.replays == chunks, f"{g.replays} replays for {sum(rows)} rows, {chunks} chunks of 16 expected"
    assert engine.runner.graph_captures() >= g.captures > 0, "catch-up captures are not counted"


def test_catch_up_graphs_capture_all_and_refuse_bad_input(trained_pair):
    engine, lane = _lane(trained_pair, [1, 1, 1], (4, 16))
    g = engine.runner.draft_graphs.catch_up
    assert g.capture_all() == 2 and g.capture_all() == 0, "capture_all must capture each size once"
    with pytest.raises(ValueError, match="at most 16"):
        g.project(*(torch.zeros(17, dtype=torch.long) for _ in range(3)))
    for bad in ((16, 4), (4, 4), (0, 4), (64, DRAFT_CONTEXT_FLUSH_ROWS + 1)):
        with pytest.raises(ValueError, match="ascending"):
            CatchUpGraphs(engine.runner.draft_graphs.graph.stack, Capturer(torch.device("cpu")), 0, bad)
    assert CATCH_UP_ROWS[-1] <= DRAFT_CONTEXT_FLUSH_ROWS, "the engine's catch-up sizes exceed the billed flush"
    assert engine.runner.capture_graphs() > 0  # the target's and drafter's graphs: none captured yet
    assert engine.runner.capture_graphs() == 0, "a second capture_graphs captured again"
