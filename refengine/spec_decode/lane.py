"""The DFlash lane: each request's drafter context (context K/V in a paged pool of the drafter's geometry,
a count of committed rows not yet projected) and the batched propose. Hidden states never leave the device:
the target's forwards write their tap features into the feature store at their KV slots
(feature_store.py), and the lane reads a request's committed rows there when it drafts. The engine sees
token spans and row counts only.

A request holds pool pages for capacity + B rows from start_request on (prompt + max_tokens context rows,
plus B scratch rows where the block's own K/V are written each draft), so a draft never allocates.

Invariant after every commit (checked before every draft): drafter context rows == committed target KV
length == position of the current token. Violations raise AlignmentError at once (no silent clamping).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from refengine.attention import make_backend
from refengine.attention.base import AttentionBackend, AttnBatch
from refengine.config import DRAFT_CONTEXT_FLUSH_ROWS
from refengine.errors import AlignmentError
from refengine.kv.pool import KvPool, blocks_for
from refengine.models.dflash import DFlashDrafter
from refengine.runner.catch_up_graphs import CatchUpGraphs
from refengine.runner.graphs import GraphRunner, StepGraph, StepRow
from refengine.spec_decode.feature_store import FeatureStore
from refengine.spec_decode.proposer import DraftItem, LaunchedDrafts

FLUSH_ROWS = DRAFT_CONTEXT_FLUSH_ROWS  # context rows projected per chunk (bounds the flush transient)


@dataclass
class DraftContext:
    capacity: int  # context rows it can hold (prompt + max_tokens); pages for + B more
    length: int = 0  # context rows whose K/V are in the pool
    pending_rows: int = 0  # committed rows after those, not yet projected (their features: the store)


class DFlashLane:
    """The DFlash Proposer (refengine.spec_decode.proposer)."""

    def __init__(self, drafter: DFlashDrafter, pool: KvPool, attention: AttentionBackend):
        self.drafter, self.pool, self.attention = drafter, pool, attention
        self.block_size = drafter.cfg.block_size
        self.capture_layers = drafter.cfg.target_layer_ids
        self.store: FeatureStore | None = None  # bound by the engine once the target's pool exists
        self._ctx: dict[int, DraftContext] = {}
        self._staged: dict[int, tuple[int, int]] = {}  # req -> (first position, rows) of this step
        self._staged_step: tuple[list[int], list[int]] | None = None  # a decode step's (stage_step)
        self.graph: GraphRunner | None = None  # the draft graph, when a graph mode is on
        self.catch_up_graphs: CatchUpGraphs | None = None  # with it: projections of pending rows, replayed
        self._sync_wait_s = 0.0
        self._catch_up_s = 0.0  # catch-up flushes since the last take_catch_up (CPU: host-timed)
        self._catch_up_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: their events

    @classmethod
    def create(
        cls, drafter: DFlashDrafter, *, context_blocks: int, max_requests: int, page_size: int, backend: str
    ) -> DFlashLane:
        """A lane whose pool holds `context_blocks` pages of context (the target pool's size: a request's
        context never outgrows its KV) plus B scratch rows for each of `max_requests` live requests."""
        m = drafter.mcfg
        blocks = context_blocks + max_requests * blocks_for(drafter.cfg.block_size, page_size)
        pool = KvPool(
            m.num_layers,
            blocks,
            page_size,
            m.num_kv_heads,
            m.head_dim,
            drafter.fc.dtype,
            drafter.fc.device,
            dummy_blocks=blocks_for(drafter.cfg.block_size, page_size),
        )
        return cls(drafter, pool, make_backend(backend, pool, m.num_heads, m.num_kv_heads, m.head_dim))

    def bind_feature_store(self, store: FeatureStore) -> None:
        if store.width != self.drafter.feature_width:
            raise AlignmentError(f"feature store rows of {store.width}, the drafter reads {self.drafter.feature_width}")
        self.store = store

    def _features(self) -> FeatureStore:
        if self.store is None:
            raise AlignmentError("the lane has no feature store (bind_feature_store was not called)")
        return self.store

    def start_request(self, req_id: int, capacity: int) -> None:
        rows = capacity + self.block_size
        if not self.pool.can_admit(rows):
            raise AlignmentError(
                f"request {req_id}: the drafter pool cannot hold {rows} rows "
                f"({self.pool.allocator.num_free} pages free): it is sized below the target's"
            )
        self.pool.admit(req_id, rows)
        self.pool.extend(req_id, rows)  # every page up front: a draft never allocates
        self._ctx[req_id] = DraftContext(capacity=capacity)

    def release(self, req_id: int) -> None:
        if self._ctx.pop(req_id, None) is not None:
            self.pool.release(req_id)
        self._staged.pop(req_id, None)
        if self._staged_step is not None and req_id in self._staged_step[0]:
            self._staged_step = None  # a step is committed whole or not at all

    def live_requests(self) -> set[int]:
        return set(self._ctx)

    def context_rows(self, req_id: int) -> int:
        c = self._ctx[req_id]
        return c.length + c.pending_rows

    def pending_rows(self, req_id: int) -> int:
        """Committed rows not projected yet: a draft of the request projects them first (more than B: a
        catch-up, _catch_up), what the adaptive policy prices and learns as C(rows)."""
        return self._ctx[req_id].pending_rows

    def persistent_bytes(self) -> int:
        """Bytes held for live requests: their pool pages (context K/V and block scratch) plus the feature
        store's rows at their target KV pages."""
        k = self.pool.k[0]
        page_bytes = 2 * len(self.pool.k) * k[0].numel() * k.element_size()
        store = self.store
        total = 0
        for rid in self._ctx:
            total += len(self.pool.table(rid)) * page_bytes
            if store is not None and rid in store.pool.seq_len:
                total += len(store.pool.table(rid)) * store.pool.page_size * store.bytes_per_token()
        return total

    # ---- rows: written to the store by the runner's forwards, staged by the runner, committed by the scheduler
    def stage_features(self, req_id: int, first_position: int, rows: int) -> None:
        if req_id not in self._ctx:
            raise AlignmentError(f"request {req_id}: features staged for a request with no drafter context")
        self._staged[req_id] = (first_position, rows)

    def commit_context(self, req_id: int, first_position: int, rows: int) -> None:
        staged = self._staged.pop(req_id, None)
        if staged is None:
            raise AlignmentError(f"request {req_id}: {rows} context rows committed but no features were staged")
        start, n = staged
        if start != first_position or not 0 < rows <= n:
            raise AlignmentError(
                f"request {req_id}: commit of rows [{first_position}, {first_position + rows}) "
                f"but the staged features cover [{start}, {start + n})"
            )
        self.append_pending_context(req_id, first_position, rows)

    def stage_step(self, req_ids: list[int], starts: list[int]) -> None:
        """A plain decode step's rows: one per request of req_ids, at positions starts[i]."""
        missing = [r for r in req_ids if r not in self._ctx]
        if missing:
            raise AlignmentError(f"requests {missing}: features staged for requests with no drafter context")
        self._staged_step = (req_ids, starts)

    def commit_step(self, req_ids: list[int]) -> None:
        """The staged decode step's row of each of `req_ids` (the staged requests, in order) becomes context."""
        step, self._staged_step = self._staged_step, None
        if step is None or step[0] != req_ids:
            staged = step[0] if step is not None else []
            raise AlignmentError(f"a decode step of requests {req_ids} committed, but staged were {staged}")
        self.append_pending_step(*step)

    def record_verify_dflash_context(self, req_id: int, start: int, committed: int) -> None:
        """After a verify at `start` committing `committed` rows ([current, d_1..d_m]), those rows' target
        features become context. The new current token (the bonus) has no features yet."""
        self.commit_context(req_id, start, committed)

    def discard_staged(self) -> None:
        self._staged.clear()
        self._staged_step = None

    def staged_requests(self) -> set[int]:
        staged = set(self._staged)
        return staged.union(self._staged_step[0]) if self._staged_step is not None else staged

    def append_pending_context(self, req_id: int, first_position: int, rows: int) -> None:
        """Rows [first_position, first_position + rows) of the request, in the store, become context."""
        c = self._ctx.get(req_id)
        if c is None:
            raise AlignmentError(f"request {req_id}: no drafter context (start_request was not called)")
        if first_position != c.length + c.pending_rows:
            raise AlignmentError(
                f"request {req_id}: features start at position {first_position}, "
                f"but the drafter context ends at {c.length + c.pending_rows}"
            )
        if first_position + rows > c.capacity:
            raise AlignmentError(
                f"request {req_id}: context overflow, {first_position + rows} rows > capacity {c.capacity}"
            )
        c.pending_rows += rows

    def append_pending_step(self, req_ids: list[int], starts: list[int]) -> None:
        """append_pending_context of one row per request (position starts[i]), all checked before any counts."""
        ctx = []
        for r, p in zip(req_ids, starts):
            c = self._ctx.get(r)
            if c is None:
                raise AlignmentError(f"request {r}: no drafter context (start_request was not called)")
            if p != c.length + c.pending_rows or p >= c.capacity:
                raise AlignmentError(
                    f"request {r}: a decode row at position {p}, but the drafter context ends at "
                    f"{c.length + c.pending_rows} (capacity {c.capacity})"
                )
            ctx.append(c)
        for c in ctx:
            c.pending_rows += 1

    # ---- projection: pending rows -> drafter context K/V ----------------------------------------------------
    def _flush_pending(self, req_ids: list[int]) -> None:
        """Project pending rows (dense ops over many rows at once) into each request's context pages.

        Rows go in chunks of at most FLUSH_ROWS so the transient (gathered features, fc output, fp32 norm,
        per-layer K/V) stays bounded when many long prompts were prefilled before the first draft; with catch-up
        graphs (a graph mode), in chunks of their largest size, each one replay (runner/catch_up_graphs.py)."""
        chunk: list[tuple[int, int, int]] = []  # (req, first position, end)
        rows, limit = 0, FLUSH_ROWS if self.catch_up_graphs is None else self.catch_up_graphs.max_rows
        for r in req_ids:
            c = self._ctx[r]
            pos, end = c.length, c.length + c.pending_rows
            while pos < end:
                k = min(end - pos, limit - rows)
                chunk.append((r, pos, pos + k))
                pos, rows = pos + k, rows + k
                if rows == limit:
                    self._project(chunk)
                    chunk, rows = [], 0
            c.length, c.pending_rows = end, 0
        if chunk:
            self._project(chunk)

    def _project(self, chunk: list[tuple[int, int, int]]) -> None:
        store = self._features()
        # one host-to-device copy per index tensor (per request, each pageable copy would wait for the device)
        sources = torch.cat([store.pool.slots(r, p, e) for r, p, e in chunk])
        positions = torch.cat([torch.arange(p, e) for _, p, e in chunk])
        slots = torch.cat([self.pool.slots(r, p, e) for r, p, e in chunk])
        if self.catch_up_graphs is not None:
            self.catch_up_graphs.project(sources, positions, slots)
            return
        feats = store.rows.index_select(0, sources.to(store.device))  # [R, F*H]
        positions, slots = positions.to(feats.device), slots.to(feats.device)
        m = self.drafter.mcfg
        for li, (k, v) in enumerate(self.drafter.context_kv(feats, positions)):
            self.pool.k[li].view(-1, m.num_kv_heads, m.head_dim)[slots] = k
            self.pool.v[li].view(-1, m.num_kv_heads, m.head_dim)[slots] = v

    def _prepare(self, items: list[DraftItem]) -> None:
        """Project pending context rows, then check every request's context ends right before its block."""
        self._flush_pending([it.req_id for it in items])
        for r, _tok, start, span in items:
            if self._ctx[r].length != start:
                raise AlignmentError(
                    f"request {r}: drafter context has {self._ctx[r].length} rows, current token is at position {start}"
                )
            if not 1 <= span <= self.block_size:
                raise AlignmentError(f"request {r}: span {span} outside 1..{self.block_size}")

    def _block(self, it: DraftItem) -> list[int]:
        return [it.current_token] + [self.drafter.cfg.mask_token_id] * (self.block_size - 1)

    @torch.inference_mode()
    def propose(self, items: list[DraftItem]) -> list[list[int]]:
        """items: (req_id, current_token, start, span) -> span - 1 drafts each (the block is always B wide;
        a truncated span just uses fewer of its rows). From the draft graph when one fits, else eager."""
        launched = self.launch(items)
        if launched is None:
            drafts = self.propose_logits(items, fp32=False).argmax(-1).tolist()  # [N, B-1]
            return [d[: span - 1] for d, (_, _, _, span) in zip(drafts, items)]
        t = time.perf_counter()
        out = launched.read()
        self._sync_wait_s += time.perf_counter() - t
        return out

    @torch.inference_mode()
    def launch(self, items: list[DraftItem]) -> LaunchedDrafts | None:
        """propose's graph path without reading the drafts back: the draft graph is queued and its device
        argmax returned (the runner feeds it to the verify graph on the device). None when no draft graph
        fits the step (nothing is run then)."""
        b = self.block_size
        steps = [StepRow(it.req_id, it.start, self._block(it), it.start + b) for it in items]
        if self.graph is None or not self.graph.fits(steps):
            return None
        # Pending context of at most B rows per request (what a verify commits) is gathered from the store
        # and projected inside the graph; more (a prompt, a plain stretch) is caught up first (_catch_up).
        if any(self._ctx[it.req_id].pending_rows > b for it in items):
            self._catch_up([it.req_id for it in items])
        pending = [self._take_pending(it.req_id) for it in items]
        self._prepare(items)
        g = self.graph.run(steps, prepare=lambda graph: self._load_context(graph, items, pending))
        return LaunchedDrafts(g.buffers.argmax, [it.span for it in items], b - 1)

    def _catch_up(self, req_ids: list[int]) -> None:
        """The graph path's flush of more pending rows than the draft graph projects (a prompt, a plain
        stretch; replays of the catch-up graphs), timed apart (take_catch_up): a switch's cost, not a steady
        draft's. On CUDA between two events, read once the step has synchronised, so the draft and the verify
        queue behind it without waiting. On the eager path every draft flushes its rows first, and that is
        its cost."""
        if self.drafter.fc.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._flush_pending(req_ids)
            end.record()
            self._catch_up_events.append((start, end))
            return
        t = time.perf_counter()
        self._flush_pending(req_ids)
        self._catch_up_s += time.perf_counter() - t

    def take_catch_up(self) -> float:
        """Seconds of catch-up flushes since the last call (the runner's `catch_up_s` timing; it waits for
        them)."""
        spent, self._catch_up_s = self._catch_up_s, 0.0
        for start, end in self._catch_up_events:
            end.synchronize()
            spent += start.elapsed_time(end) / 1e3
        self._catch_up_events.clear()
        return spent

    def take_sync_wait(self) -> float:
        """Seconds spent waiting for draft-graph results since the last call (the runner's host-time split)."""
        wait, self._sync_wait_s = self._sync_wait_s, 0.0
        return wait

    def _take_pending(self, req_id: int) -> int:
        """The request's pending row count, now counted as cached: the draft graph writes their K/V before
        anything reads them."""
        c = self._ctx[req_id]
        n, c.length, c.pending_rows = c.pending_rows, c.length + c.pending_rows, 0
        return n

    def _load_context(self, graph: StepGraph, items: list[DraftItem], pending: list[int]) -> None:
        """Request i's n pending rows go to context rows [i*B, i*B + n) of the graph: the graph gathers their
        features from the store (`sources`: target KV slots) and writes their K/V at `slots`; the other rows
        write the dummy page."""
        ctx, b = graph.buffers.context, self.block_size
        assert ctx is not None
        store = self._features()
        pos = [0] * ctx.positions.shape[0]
        slots = [self.pool.dummy_slot] * len(pos)
        sources = [store.pool.dummy_slot] * len(pos)
        for i, (it, n) in enumerate(zip(items, pending)):
            if n:
                first = it.start - n
                pos[i * b : i * b + n] = range(first, it.start)
                slots[i * b : i * b + n] = self.pool.slot_list(it.req_id, first, it.start)
                sources[i * b : i * b + n] = store.pool.slot_list(it.req_id, first, it.start)
        # pinned: a pageable copy could wait for the catch-up queued before it
        host = torch.tensor([pos, slots, sources], pin_memory=ctx.positions.is_cuda)  # [3, bucket * B]
        for buf, row in zip((ctx.positions, ctx.slots, ctx.sources), host):
            buf.copy_(row, non_blocking=True)

    @torch.inference_mode()
    def propose_logits(self, items: list[DraftItem], fp32: bool = True) -> torch.Tensor:
        """The drafter's logits [N, B-1, V] for rows 1..B-1 of each request's block (eager)."""
        self._prepare(items)
        b, dev = self.block_size, self.drafter.fc.device
        tokens = torch.tensor([self._block(it) for it in items], device=dev).view(-1)
        batch = AttnBatch(
            q_lens=[b] * len(items),
            kv_lens=[it.start + b for it in items],
            block_tables=[self.pool.table(it.req_id) for it in items],
            slots=torch.cat([self.pool.slots(it.req_id, it.start, it.start + b) for it in items]).to(dev),
            positions=torch.cat([torch.arange(it.start, it.start + b) for it in items]).to(dev),
            causal=False,
        )
        return self.drafter.draft_logits(tokens, batch, self.pool, self.attention, fp32=fp32)
