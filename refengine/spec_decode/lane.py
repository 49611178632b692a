"""The DFlash lane: each request's drafter context (context K/V in a paged pool of the drafter's geometry,
a count of committed rows not yet projected); the batched draft forward is its mixin, lane_draft.py. Hidden
states never leave the device: the target's forwards write their tap features into the feature store at
their KV slots (feature_store.py), and the lane reads a request's committed rows there when it drafts. The
engine sees token spans and row counts only.

A request holds pool pages for capacity + B rows from start_request on (prompt + max_tokens context rows,
plus B scratch rows where the block's own K/V are written each draft), so a draft never allocates.

Invariant after every commit (checked before every draft): drafter context rows == committed target KV
length == position of the current token. Violations raise AlignmentError at once (no silent clamping).
"""

from __future__ import annotations

import torch

from refengine.attention import make_backend
from refengine.attention.base import AttentionBackend
from refengine.errors import AlignmentError
from refengine.kv.pool import KvPool, blocks_for
from refengine.models.dflash import DFlashDrafter
from refengine.spec_decode.draft_executor import DraftExecutor
from refengine.spec_decode.feature_store import FeatureStore
from refengine.spec_decode.lane_draft import DraftContext, LaneDraft


class DFlashLane(LaneDraft):
    """The DFlash Proposer (refengine.spec_decode.proposer)."""

    def __init__(self, drafter: DFlashDrafter, pool: KvPool, attention: AttentionBackend):
        self.drafter, self.pool, self.attention = drafter, pool, attention
        self.block_size = drafter.cfg.block_size
        self.capture_layers = drafter.cfg.target_layer_ids
        self.store: FeatureStore | None = None  # bound by the engine once the target's pool exists
        self._ctx: dict[int, DraftContext] = {}
        self._staged: dict[int, tuple[int, int]] = {}  # req -> (first position, rows) of this step
        self._staged_step: tuple[list[int], list[int]] | None = None  # a decode step's (stage_step)
        self.executor: DraftExecutor | None = None  # runs the drafts on graphs, when a graph mode is on
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

    def can_start(self, capacities: list[int]) -> bool:
        """Whether the pool can give each of these requests capacity + B rows, together."""
        page = self.pool.page_size
        need = sum(blocks_for(c + self.block_size, page) for c in capacities)
        return need <= self.pool.allocator.num_free - self.pool.outstanding_promises()

    def attach_cached(self, req_id: int, rows: int) -> None:
        """Rows [0, rows) of cached target blocks become pending context: their features are in the store at
        the blocks' slots (shared through the request's block table), projected at its first draft like a
        prompt's. The drafter context K/V is per request, so each hit projects its rows once."""
        self.append_pending_context(req_id, 0, rows)

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

    def persistent_bytes(self) -> int:
        """Bytes held for live requests: their pool pages (context K/V and block scratch) plus the feature
        store's rows at their target KV pages."""
        k = self.pool.k[0]
        page_bytes = 2 * len(self.pool.k) * k[0].numel() * k.element_size()
        store = self.store
        total = 0
        target_blocks: set[int] = set()  # distinct: prefix-cache hits share target blocks (and their rows)
        for rid in self._ctx:
            total += len(self.pool.table(rid)) * page_bytes
            if store is not None and rid in store.pool.seq_len:
                target_blocks.update(store.pool.table(rid))
        if store is not None:
            total += len(target_blocks) * store.pool.page_size * store.bytes_per_token()
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
