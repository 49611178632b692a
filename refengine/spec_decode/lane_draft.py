"""The DFlash lane's draft forward (a mixin of DFlashLane, refengine/spec_decode/lane.py): pending context rows
projected into the drafter's context K/V (eagerly in chunks, or by replaying catch-up graphs), the block
forward (the draft graph, or eagerly), and their timings. `launch` leaves the drafts on the device for the
verify graph (refengine/runner/draft_handoff.py); `propose` reads them back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from refengine.attention.base import AttentionBackend, AttnBatch
from refengine.config import DRAFT_CONTEXT_FLUSH_ROWS
from refengine.errors import AlignmentError
from refengine.kv.pool import KvPool
from refengine.models.dflash import DFlashDrafter
from refengine.spec_decode.draft_executor import DraftBlock, DraftExecutor
from refengine.spec_decode.feature_store import FeatureStore
from refengine.spec_decode.proposer import DraftItem, LaunchedDrafts

FLUSH_ROWS = DRAFT_CONTEXT_FLUSH_ROWS  # context rows projected per chunk (bounds the flush transient)


@dataclass
class DraftContext:
    capacity: int  # context rows it can hold (prompt + max_tokens); pages for + B more
    length: int = 0  # context rows whose K/V are in the pool
    pending_rows: int = 0  # committed rows after those, not yet projected (their features: the store)


class LaneDraft:
    """DFlashLane's draft forward; it holds the state below (DFlashLane.__init__ sets it)."""

    drafter: DFlashDrafter
    pool: KvPool
    attention: AttentionBackend
    block_size: int
    executor: DraftExecutor | None
    _ctx: dict[int, DraftContext]
    _sync_wait_s: float
    _catch_up_s: float
    _catch_up_events: list[tuple[torch.cuda.Event, torch.cuda.Event]]

    def _features(self) -> FeatureStore:
        raise NotImplementedError

    # ---- projection: pending rows -> drafter context K/V ----------------------------------------------------
    def _flush_pending(self, req_ids: list[int]) -> None:
        """Project pending rows (dense ops over many rows at once) into each request's context pages.

        Rows go in chunks of at most FLUSH_ROWS so the transient (gathered features, fc output, fp32 norm,
        per-layer K/V) stays bounded when many long prompts were prefilled before the first draft; with an
        executor (a graph mode), in chunks of what its catch-up graphs take, each one replay."""
        chunk: list[tuple[int, int, int]] = []  # (req, first position, end)
        rows, limit = 0, FLUSH_ROWS if self.executor is None else self.executor.catch_up_rows
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
        if self.executor is not None:
            self.executor.project(sources, positions, slots)
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
    def launch(self, items: list[DraftItem], full_block: bool = False) -> LaunchedDrafts | None:
        """propose's graph path without reading the drafts back: the draft graph is queued and its device
        argmax returned (the runner feeds it to the verify graph on the device). None when no draft graph
        fits the step (nothing is run then). `full_block`: the graph scoring the whole block, not the least
        score cap its spans need."""
        b, executor = self.block_size, self.executor
        if executor is None or not executor.fits(len(items)):
            return None
        # Pending context of at most B rows per request (what a verify commits) is gathered from the store
        # and projected inside the graph; more (a prompt, span-1 steps) is caught up first (_catch_up).
        if any(self._ctx[it.req_id].pending_rows > b for it in items):
            self._catch_up([it.req_id for it in items])
        blocks = [self._draft_block(it, self._take_pending(it.req_id)) for it in items]
        self._prepare(items)
        spans = [it.span for it in items]
        return executor.draft(blocks, spans, b if full_block else max(spans))

    def _catch_up(self, req_ids: list[int]) -> None:
        """The graph path's flush of more pending rows than the draft graph projects (a prompt, span-1 steps;
        replays of the catch-up graphs), timed apart (take_catch_up): a switch's cost, not a steady
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

    def _draft_block(self, it: DraftItem, pending: int) -> DraftBlock:
        """The request's block, after its `pending` context rows (positions, drafter-pool slots, store slots)."""
        first = it.start - pending
        store = self._features()
        return DraftBlock(
            it.req_id,
            it.start,
            self._block(it),
            list(range(first, it.start)),
            self.pool.slot_list(it.req_id, first, it.start) if pending else [],
            store.pool.slot_list(it.req_id, first, it.start) if pending else [],
        )

    @torch.inference_mode()
    def draft_distribution_logits(self, items: list[DraftItem]) -> torch.Tensor:
        """The drafter's fp32 logits [N, B-1, V] for rows 1..B-1 of each request's block (what sampled drafts
        are drawn from): from the draft graph's final rows when one fits the step, else eagerly."""
        launched = self.launch(items, full_block=True)
        if launched is None or launched.hidden is None:
            return self.propose_logits(items)
        b = self.block_size
        rows = torch.tensor([i * b + j for i in range(len(items)) for j in range(1, b)], device=launched.hidden.device)
        logits = torch.nn.functional.linear(launched.hidden[rows], self.drafter.lm_head)
        return logits.float().view(len(items), b - 1, -1)

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
