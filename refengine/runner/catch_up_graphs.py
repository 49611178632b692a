"""The drafter lane's catch-up projection as CUDA graphs: context rows a request carried past a prompt or a
run of span-1 steps (more than the draft graph projects in-graph) -> every drafter layer's K/V, replayed from a few
captured row counts instead of run eagerly.

Why: an eager catch-up cost ~8 ms on the H200 host at Qwen3-4B shapes whatever its rows (0.3 ms of GPU
work). A torch.profiler trace of a 101-row one put 7.4 ms of CPU time in its
11 GEMMs (cuBLAS meeting a row count it had not seen: every catch-up has a new one) and most of the rest
in ~100 eager launches. A replay of a captured shape pays neither. Row counts are padded up to the next
captured size (padding rows read the feature store's dummy row and write the drafter pool's dummy page);
longer catch-ups go in chunks of the largest. Every size shares one set of input buffers (views of the
largest), and the graphs' temporaries live in the engine's shared capture pool. Their memory is the
DFlash reservation's context flush scratch (DRAFT_CONTEXT_FLUSH_ROWS rows billed, at most as many used).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from refengine.config import DRAFT_CONTEXT_FLUSH_ROWS
from refengine.models.segmented import ContextInputs, SegmentedStack
from refengine.runner.capture import Capturer

CATCH_UP_ROWS = (64, 256, 1024)  # captured row counts (4B shapes: a 1024-row catch-up 0.87 ms, syncs in)


class CatchUpGraphs:
    """`project(sources, positions, slots)`: rows gathered from the feature store at `sources` (target KV
    slots), projected at `positions`, their K/V written into the drafter pool at `slots`."""

    def __init__(
        self, stack: SegmentedStack, capturer: Capturer, store_dummy_slot: int, sizes: tuple[int, ...] = CATCH_UP_ROWS
    ):
        if stack.context_proj is None or stack.feature_store is None:
            raise ValueError("catch-up graphs need the drafter stack's context projection and feature store")
        if list(sizes) != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > DRAFT_CONTEXT_FLUSH_ROWS:
            raise ValueError(
                f"catch-up row counts {sizes} must be distinct, ascending, positive and at most "
                f"{DRAFT_CONTEXT_FLUSH_ROWS} (the rows the memory reservation bills for a flush)"
            )
        self.stack, self.capturer, self.sizes = stack, capturer, tuple(sizes)
        pool = stack.pool
        self.dummy_slot = pool.dummy_slot  # padding rows' K/V land here
        self.store_dummy_slot = store_dummy_slot  # and read this store row
        c, top = stack.cfg, self.sizes[-1]
        fc, dev = stack.context_proj[0], stack.context_proj[0].device

        def z(*shape: int, dt: torch.dtype = fc.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=dev)

        self._inputs = ContextInputs(
            feats=z(top, fc.shape[1]),
            positions=z(top, dt=torch.long),
            slots=z(top, dt=torch.long).fill_(self.dummy_slot),
            sources=z(top, dt=torch.long).fill_(store_dummy_slot),
            k=z(top, c.num_kv_heads, c.head_dim),
        )
        self._graphs: dict[int, Callable[[], None]] = {}
        self.captures = 0
        self.replays = 0
        self.on_launch: Callable[[], None] | None = None  # told as each replay is queued (ModelRunner's clock)

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def _view(self, rows: int) -> ContextInputs:
        i = self._inputs
        return ContextInputs(i.feats[:rows], i.positions[:rows], i.slots[:rows], i.sources[:rows], i.k[:rows])

    def _graph(self, rows: int) -> Callable[[], None]:
        g = self._graphs.get(rows)
        if g is None:
            ctx, stack = self._view(rows), self.stack
            # the warm-up runs on what the inputs hold: the dummy rows (capture_all) or the rows of the catch-up
            # being projected (project fills them first), whose K/V it writes as the replay then does again
            g = self._graphs[rows] = self.capturer.capture(lambda: stack.project_context(ctx))
            self.captures += 1
        return g

    def capture_all(self) -> int:
        """Capture every size now (no catch-up inside a timed step pays a capture); returns how many were new."""
        before = self.captures
        self._reset()
        for rows in self.sizes:
            self._graph(rows)
        return self.captures - before

    def _reset(self) -> None:
        i = self._inputs
        i.positions.zero_()
        i.slots.fill_(self.dummy_slot)
        i.sources.fill_(self.store_dummy_slot)

    def project(self, sources: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Project n <= max_rows rows (host int64 tensors [n] each): one replay of the smallest size that holds
        them, the rest of it padding."""
        n = sources.shape[0]
        rows = next((s for s in self.sizes if s >= n), None)
        if rows is None or not n == positions.shape[0] == slots.shape[0]:
            raise ValueError(f"a catch-up chunk of {n} rows: at most {self.max_rows}, one position and slot each")
        pad = rows - n
        ctx = self._view(rows)
        for buf, host, fill in (
            (ctx.sources, sources, self.store_dummy_slot),
            (ctx.positions, positions, 0),
            (ctx.slots, slots, self.dummy_slot),
        ):
            if pad:
                host = torch.cat([host, torch.full((pad,), fill, dtype=torch.long)])
            if buf.is_cuda:  # a pageable copy may wait for the device; a pinned one queues
                host = host.pin_memory()
            buf.copy_(host, non_blocking=True)
        if self.on_launch is not None:
            self.on_launch()
        self._graph(rows)()
        self.replays += 1
