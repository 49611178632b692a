"""The DFlash lane's drafting on captured graphs (spec_decode/draft_executor.py's DraftExecutor): the draft
graph (the drafter's block forward, its pending context gathered from the feature store and projected inside
the graph) and the catch-up graphs (longer runs of context rows, projected before it)."""

from __future__ import annotations

import torch

from refengine.runner.catch_up_graphs import CatchUpGraphs
from refengine.runner.graphs import GraphRunner, StepGraph, StepRow
from refengine.spec_decode.draft_executor import DraftBlock
from refengine.spec_decode.proposer import LaunchedDrafts


class DraftGraphs:
    def __init__(self, graph: GraphRunner, catch_up: CatchUpGraphs, pool_dummy_slot: int, store_dummy_slot: int):
        self.graph, self.catch_up = graph, catch_up
        self.dummy = (pool_dummy_slot, store_dummy_slot)  # where a padding context row writes, and reads
        # the draft graph's context rows on the host, by row count: [3, rows] (positions, slots, sources), pinned
        # on CUDA and rewritten in place
        self._context_host: dict[int, torch.Tensor] = {}

    @property
    def catch_up_rows(self) -> int:
        return self.catch_up.max_rows

    def runners(self) -> list[GraphRunner | CatchUpGraphs]:
        return [self.graph, self.catch_up]

    def fits(self, n: int) -> bool:
        return self.graph.bucket_for(n) is not None

    def project(self, sources: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.catch_up.project(sources, positions, slots)

    def draft(self, blocks: list[DraftBlock], spans: list[int], widest: int) -> LaunchedDrafts:
        steps = [StepRow(b.req_id, b.start, b.tokens, b.start + len(b.tokens)) for b in blocks]
        g = self.graph.run(steps, prepare=lambda graph: self._load_context(graph, blocks), widest=widest)
        # the graph scores rows 1..cap-1 a block
        return LaunchedDrafts(g.buffers.argmax, spans, g.cap - 1, hidden=g.buffers.hidden)

    def _load_context(self, graph: StepGraph, blocks: list[DraftBlock]) -> None:
        """Request i's n pending rows go to context rows [i*B, i*B + n) of the graph: the graph gathers their
        features from the store (`sources`) and writes their K/V at `slots`; the other rows write the dummy
        page. The rows go through a host buffer kept per row count (a new tensor from nested lists cost
        ~0.3 ms of a c32 step's host time while the device waited), pinned on CUDA and, like
        StepGraph.staging, safe to rewrite every draft: each step ends by reading its results back."""
        ctx, b = graph.buffers.context, self.graph.span
        assert ctx is not None
        rows = ctx.positions.shape[0]
        pos, slots, sources = [0] * rows, [self.dummy[0]] * rows, [self.dummy[1]] * rows
        for i, blk in enumerate(blocks):
            n = len(blk.positions)
            pos[i * b : i * b + n] = blk.positions
            slots[i * b : i * b + n] = blk.slots
            sources[i * b : i * b + n] = blk.sources
        host = self._context_host.get(rows)
        if host is None:
            host = torch.zeros((3, rows), dtype=torch.int64, pin_memory=ctx.positions.is_cuda)
            self._context_host[rows] = host
        view = host.numpy()
        view[0], view[1], view[2] = pos, slots, sources
        for buf, row in zip((ctx.positions, ctx.slots, ctx.sources), host):
            buf.copy_(row, non_blocking=True)
