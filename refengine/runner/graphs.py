"""CUDA graphs for the steps whose shape repeats: plain decode, verify, and the drafter's block forward.

A graph is captured per shape (kind, batch bucket, row cap): `bucket` requests and bucket x cap rows, where
any request may hold up to `span` rows (FlashInfer's graph-mode plan takes any split of the rows). A step of
N <= bucket requests replays the smallest cap that holds its rows: real rows are packed first (in plan
order), padding requests (one row each, or a whole block for the drafter) follow on the pool's dummy pages,
and any rows left over are padding too. Verify graphs have caps 2, 4, ..., span (`row_caps`), so a step
mixing span-1 requests with a few full spans (adaptive speculation) computes about its own rows, not
bucket x span. The drafter's blocks are always B rows (its attention within a block is non-causal); its caps
are score caps instead: a draft graph of cap c scores (LM head + argmax) rows 1..c-1 of each block, the drafts
a verify of span <= c reads (at Qwen3-4B shapes and c32 the LM head over 15 rows a block is 0.60 ms, over 3
rows 0.24 on an H200). Graphs of one bucket share one attention
wrapper, first planned at the bucket's most rows. Dense segments are captured; attention is replayed from a
FlashInfer CUDA-graph-mode wrapper re-planned on the host before every replay, either eagerly between the
segments ("piecewise", the upstream design) or inside one graph ("full").

The capture-shape rule: a graph is always captured at its key's full row count (bucket x span), never at
the rows of the step that happened to trigger the capture. So a step whose spans were truncated by the
budget replays a full-shape graph with padding (nothing is under-computed), and a longer step can never
replay a graph captured short. `capture_shape_rule=False` (tests only) reproduces upstream's bug instead:
capture at the first step's rows, replay every later step of that bucket with only those rows computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from refengine.attention.base import AttnBatch
from refengine.kv.pool import KvPool
from refengine.models.segmented import SegmentedStack, StepState
from refengine.runner.capture import Capturer, sync
from refengine.runner.shapes import batch_buckets


@dataclass(frozen=True)
class StepRow:
    """One real request of a step: `tokens` fed at positions [start, start + len(tokens)), KV at `slots`."""

    req_id: int
    start: int
    tokens: list[int]
    kv_len: int  # keys the request attends: start + len(tokens) (verify) or start + B (draft)


class StepGraph:
    """One captured shape: persistent buffers, the attention for its batch, the replayable pieces."""

    def __init__(
        self,
        stack: SegmentedStack,
        attention,
        bucket: int,
        cap: int,
        rows: int,
        causal: bool,
        buffers: StepState,
        pad_rows: int = 1,
    ):
        self.stack, self.attention, self.bucket, self.cap, self.causal = stack, attention, bucket, cap, causal
        self.pad_rows = pad_rows  # rows of a padding request: 1, or the drafter's whole block
        self.rows = rows  # rows computed at replay (== bucket x cap under the capture-shape rule)
        self.buffers = buffers  # every row of the shape: results are read here (stale past `rows`, rule off)
        self.state = buffers if rows == buffers.ids.shape[0] else buffers.head(rows)  # what the pieces compute
        self.pieces: list[Callable[[], None]] = []
        # host staging of (ids, positions, slots), pinned on CUDA so the copies are truly asynchronous; safe to
        # rewrite every step because each step ends by reading its results back (a sync)
        self.staging = torch.zeros((3, rows), dtype=torch.long, pin_memory=buffers.ids.is_cuda)

    def layout(self, steps: list[StepRow], pool: KvPool) -> tuple[AttnBatch, torch.Tensor]:
        """Pack the real rows, then the padding requests; returns the attention batch and a [3, rows] int64
        (ids, positions, slots) for the persistent inputs."""
        page, dummy = pool.page_size, pool.dummy_blocks
        pad_rows = self.pad_rows
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        tables: list[list[int]] = []
        for s in steps:
            n = len(s.tokens)
            ids += s.tokens
            pos += range(s.start, s.start + n)
            slots += pool.slot_list(s.req_id, s.start, s.start + n)
            q_lens.append(n)
            kv_lens.append(s.kv_len)
            tables.append(pool.table(s.req_id))
        for _ in range(self.bucket - len(steps)):
            ids += [0] * pad_rows
            pos += range(pad_rows)
            slots += [dummy[p // page] * page + p % page for p in range(pad_rows)]
            q_lens.append(pad_rows)
            kv_lens.append(pad_rows)
            tables.append(dummy)
        if len(ids) > self.rows:
            raise ValueError(f"step of {len(ids)} rows does not fit a graph of {self.rows}")
        # rows past the padding requests' are padding too: not attended, written to a dummy slot
        staging = self.staging.numpy()
        staging[0, : len(ids)], staging[0, len(ids) :] = ids, 0
        staging[1, : len(ids)], staging[1, len(ids) :] = pos, 0
        staging[2, : len(ids)], staging[2, len(ids) :] = slots, dummy[0] * page
        batch = AttnBatch(q_lens, kv_lens, tables, torch.empty(0), torch.empty(0), causal=self.causal)
        return batch, self.staging

    def replay(
        self,
        batch: AttnBatch,
        inputs: torch.Tensor,
        fill: Callable[[StepState], None] | None = None,
        on_launch: Callable[[], None] | None = None,
    ) -> None:
        """`fill(state)` rewrites inputs on the device after the staged ones land (a verify's drafts, straight
        from the draft graph's buffers); `on_launch()` runs once the host work is done, as the first piece is
        queued."""
        st = self.state
        st.ids.copy_(inputs[0], non_blocking=True)
        st.positions.copy_(inputs[1], non_blocking=True)
        st.slots.copy_(inputs[2], non_blocking=True)
        if fill is not None:
            fill(st)
        self.attention.plan(batch)
        if on_launch is not None:
            on_launch()
        for piece in self.pieces:
            piece()


class GraphRunner:
    """Captured shapes of one model (`stack`) for one kind of step, by batch bucket."""

    def __init__(
        self,
        stack: SegmentedStack,
        make_attention: Callable[[int], object],
        *,
        mode: str,
        span: int,
        max_batch: int,
        causal: bool,
        score: str,
        capturer: Capturer,
        capture_shape_rule: bool = True,
        caps: tuple[int, ...] | None = None,
    ):
        if mode not in ("piecewise", "full"):
            raise ValueError(f"graph mode {mode!r}: a GraphRunner runs 'piecewise' or 'full'")
        caps = tuple(sorted(set(caps))) if caps else (span,)
        if caps[-1] != span or caps[0] < 1:
            raise ValueError(f"row caps {caps} must lie in 1..span and end at span {span}")
        self.stack, self.make_attention, self.mode, self.span = stack, make_attention, mode, span
        self.buckets, self.causal, self.score, self.capturer = batch_buckets(max_batch), causal, score, capturer
        self.capture_shape_rule, self.caps = capture_shape_rule, caps
        self.graphs: dict[tuple[int, int], StepGraph] = {}  # (bucket, cap) -> captured shape
        self._attention: dict[int, object] = {}  # bucket -> the wrapper its shapes share
        self.replays = self.captures = 0
        self.on_launch: Callable[[], None] | None = None  # told as each replay is queued (ModelRunner's clock)

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, steps: list[StepRow]) -> bool:
        return self.bucket_for(len(steps)) is not None and all(len(s.tokens) <= self.span for s in steps)

    def shape_for(self, n: int, rows: int, widest: int | None = None) -> tuple[int, int]:
        """(bucket, cap) a step of n requests and `rows` real rows replays (n must fit a bucket). With the
        capture-shape rule off (tests) there is one cap, the span, as upstream had. A drafter's step (score
        caps): the least cap >= `widest`, the largest span any of its drafts serve (default: the block)."""
        bucket = self.bucket_for(n)
        assert bucket is not None, f"{n} requests fit no bucket of {self.buckets}"
        caps = self.caps if self.capture_shape_rule else (self.span,)
        if self.score == "block":
            return bucket, next((c for c in caps if c >= (widest or self.span)), self.span)
        need = rows + (bucket - n) * (1 if self.causal else self.span)
        return bucket, next((c for c in caps if bucket * c >= need), self.span)

    def _rows(self, bucket: int, cap: int) -> int:
        """Rows a shape computes: bucket x cap, or a drafter's bucket x B whatever its score cap."""
        return bucket * (self.span if self.score == "block" else cap)

    def executed_rows(self, n: int, rows: int) -> int:
        """Rows the graph computes for a step of n requests and `rows` real rows (the adaptive policy's cost)."""
        bucket, cap = self.shape_for(n, rows)
        return bucket * cap

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every shape now (bench / server start-up: no capture inside a timed or served step);
        returns how many were new."""
        before = self.captures
        for bucket in self.buckets:
            for cap in self.caps:
                self._graph(bucket, cap, self._rows(bucket, cap))
        return self.captures - before

    @torch.inference_mode()
    def time_shapes(self, reps: int = 3) -> dict[tuple[int, int], float]:
        """Seconds per replay of every captured shape on the dummy pages (the adaptive policy's start-up cost
        table). Inputs and written slots are reset to the dummy pages first, so no request's KV is touched."""
        out = {}
        pool = self.stack.pool
        dummy = pool.dummy_slot
        for (bucket, cap), g in self.graphs.items():
            for buf in (g.state.ids, g.state.positions):
                buf.zero_()
            g.state.slots.fill_(dummy)
            if g.buffers.context is not None:
                g.buffers.context.slots.fill_(dummy)
            self._plan_dummy(g.attention, bucket, g.rows)
            sync(g.state.ids)
            t = time.perf_counter()
            for _ in range(reps):
                for piece in g.pieces:
                    piece()
            sync(g.state.ids)
            out[(bucket, cap)] = (time.perf_counter() - t) / reps
        return out

    def _attention_for(self, bucket: int):
        att = self._attention.get(bucket)
        if att is None:
            att = self._attention[bucket] = self.make_attention(bucket)
            # The wrapper's first plan fixes the most rows it may ever see (FlashInfer sizes its graph-mode
            # work lists on it): the bucket's largest shape, all on the dummy pages.
            self._plan_dummy(att, bucket, bucket * self.span)
        return att

    def _plan_dummy(self, attention, bucket: int, rows: int) -> None:
        q_lens = [rows // bucket] * bucket
        q_lens[0] += rows % bucket
        dummy = self.stack.pool.dummy_blocks
        attention.plan(AttnBatch(q_lens, q_lens, [dummy] * bucket, torch.empty(0), torch.empty(0), causal=self.causal))

    def _graph(self, bucket: int, cap: int, rows_now: int) -> StepGraph:
        g = self.graphs.get((bucket, cap))
        if g is not None:
            return g
        full = self._rows(bucket, cap)
        rows = full if self.capture_shape_rule else rows_now  # the rule: capture the key's full shape
        buffers = self._state(bucket, full, cap)
        pool = self.stack.pool
        buffers.slots.fill_(pool.dummy_slot)  # the warm-up run must not touch a real slot
        if buffers.context is not None:
            buffers.context.slots.fill_(pool.dummy_slot)
        pad = 1 if self.causal else self.span  # a padding request's rows: one, or a drafter's whole block
        g = StepGraph(self.stack, self._attention_for(bucket), bucket, cap, rows, self.causal, buffers, pad)
        self._plan_dummy(g.attention, bucket, rows)  # warm-up and capture runs touch no request's KV
        g.pieces = self._capture(g)
        self.graphs[(bucket, cap)] = g
        self.captures += 1
        return g

    def _state(self, bucket: int, rows: int, cap: int) -> StepState:
        w = self.stack.embed
        if self.score == "all":
            index = torch.arange(rows)
        else:  # "block": rows 1..cap-1 of each block (the drafter's predictions a span <= cap reads)
            index = torch.tensor([i * self.span + j for i in range(bucket) for j in range(1, cap)])
            # a bucket's score caps compute the same rows and replay one at a time: they share its buffers
            # but for what they score (the memory planner bills a draft bucket's buffers once)
            shared = next((g.buffers for (b, _), g in self.graphs.items() if b == bucket), None)
            if shared is not None:
                index = index.to(w.device)
                return replace(shared, score_index=index, argmax=torch.zeros_like(index))
        width = self.stack.context_proj[0].shape[1] if self.stack.context_proj is not None else 0
        return StepState.allocate(
            self.stack.cfg, rows, index, len(self.stack.tap_layers), w.dtype, w.device, context_width=width
        )

    def _capture(self, g: StepGraph) -> list[Callable[[], None]]:
        # The pieces close over the state and attention, never over `g` itself: g holds its pieces, so a closure
        # over g would make a reference cycle that keeps a dropped engine's buffers alive until a gc pass.
        st, attention, stack, n = g.state, g.attention, self.stack, len(self.stack.layers)

        def seg(i: int) -> Callable[[], None]:
            return lambda: stack.segment(i, st)

        def attn(i: int) -> Callable[[], None]:
            return lambda: attention.run(i, st.q, st.attn_out)

        if self.mode == "full":

            def whole() -> None:
                for i in range(n):
                    stack.segment(i, st)
                    attention.run(i, st.q, st.attn_out)
                stack.segment(n, st)

            return [self.capturer.capture(whole)]
        pieces: list[Callable[[], None]] = []
        for i in range(n):
            pieces += [self.capturer.capture(seg(i)), attn(i)]
        return pieces + [self.capturer.capture(seg(n))]

    def run(
        self,
        steps: list[StepRow],
        prepare: Callable[[StepGraph], None] | None = None,
        fill: Callable[[StepState], None] | None = None,
        widest: int | None = None,
    ) -> StepGraph:
        """Replay the graph of this step's bucket; read results from the returned graph's buffers.
        `prepare(graph)` fills extra persistent inputs (the drafter's context rows) before the replay;
        `fill(state)` rewrites token ids on the device (StepGraph.replay); `widest`: a drafter's largest span
        (shape_for)."""
        assert self.fits(steps)
        real = sum(len(s.tokens) for s in steps)
        bucket, cap = self.shape_for(len(steps), real, widest)
        rows_now = real + (bucket - len(steps)) * (self.span if not self.causal else 1)
        g = self._graph(bucket, cap, rows_now)
        if not self.capture_shape_rule and rows_now > g.rows:
            steps = _truncate(steps, g.rows - (bucket - len(steps)))  # upstream's bug: too few rows computed
        batch, inputs = g.layout(steps, self.stack.pool)
        if prepare is not None:
            prepare(g)
        g.replay(batch, inputs, fill, self.on_launch)
        self.replays += 1
        return g


def _truncate(steps: list[StepRow], rows: int) -> list[StepRow]:
    out = []
    for s in steps:
        keep = max(min(len(s.tokens), rows), 1)
        rows -= keep
        out.append(StepRow(s.req_id, s.start, s.tokens[:keep], s.kv_len - (len(s.tokens) - keep)))
    return out
