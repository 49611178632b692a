"""Attention for one captured graph shape: a fixed batch of `batch` requests (real ones first, then padding
requests on the pool's dummy pages), planned on the host before every replay.

- FlashInfer (CUDA): a `BatchPrefillWithPagedKVCacheWrapper` in CUDA-graph mode with persistent index
  buffers. plan() rewrites those buffers and the wrapper's work lists; the captured kernel reads them at run
  time, so a graph captured at one KV length replays correctly at any other. Its first plan (FlashInfer's own)
  fixes the most query rows it may ever see: the shape's full row count; later plans are lean (lean_plan.py).
  The wrappers of a device share one float workspace, sized by the engine for its largest plan
  (attention/workspace.py); a first plan past it is refused with the numbers before FlashInfer's overflow.
- Torch (any device): the reference backend re-prepared each step (the CPU tests of the graph runner).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from refengine.attention.base import AttnBatch
from refengine.attention.lean_plan import PlanArrays, lean_plan, lean_plan_supported
from refengine.attention.torch_backend import TorchPagedAttention
from refengine.attention.workspace import device_sm_count, flashinfer_float_workspace_bytes
from refengine.errors import UnsupportedConfigError
from refengine.kv.pool import KvPool


def page_entries_capacity(pool: KvPool, batch: int) -> int:
    """The most page-index entries a plan of `batch` requests can list: every real page once (a page belongs to
    one request), plus each padding request's dummy pages, which repeat. The pool's page count alone fell short
    where full-length requests fill the pool and padding requests pad the bucket (5 requests of 16 pages on 81
    real pages, 3 padding requests: 83 entries against 82 pages; tests/unit/test_graphs.py)."""
    return pool.k[0].shape[0] + batch * len(pool.dummy_blocks)


class TorchGraphAttention:
    skip_replan = False  # tests only: keep the first plan for ever (a stale plan, the bug class it guards)

    def __init__(self, pool: KvPool):
        self.pool, self._backend, self._rows = pool, TorchPagedAttention(pool), 0

    def plan(self, batch: AttnBatch) -> None:
        if self.skip_replan and self._rows:
            return
        self._backend.prepare(batch)
        self._rows = batch.num_tokens

    def run(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        n = self._rows  # rows past the planned ones are padding: left as they are, as FlashInfer does
        out[:n].copy_(self._backend.attend(layer, q[:n])[:n])


class FlashInferGraphAttention:
    _workspaces: dict[torch.device, torch.Tensor] = {}
    skip_replan = False  # tests only: keep the first plan for ever (a stale plan, the bug class it guards)
    use_lean_plan = True  # lean plans after the first, where lean_plan_supported (read once, at the first plan)

    def __init__(
        self, pool: KvPool, batch: int, num_heads: int, num_kv_heads: int, head_dim: int, workspace_bytes: int
    ):
        """Every wrapper of a device shares one float workspace of at least `workspace_bytes` (the engine's
        graph_float_workspace_bytes: the same for all its wrappers, so one allocation): the engine's graphs replay
        one at a time. A smaller one left by an earlier engine is replaced (its wrappers keep theirs)."""
        import flashinfer  # lazily: CPU installs never need it

        dev = pool.k[0].device
        ws = self._workspaces.get(dev)
        if ws is None or ws.numel() < workspace_bytes:
            ws = self._workspaces[dev] = torch.empty(workspace_bytes, dtype=torch.uint8, device=dev)
        self._num_sms, self._workspace_bytes = device_sm_count(dev), ws.numel()
        pages = page_entries_capacity(pool, batch)
        self.pool, self.heads = pool, (num_heads, num_kv_heads, head_dim)
        self._indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self._kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self._indices = torch.zeros(pages, dtype=torch.int32, device=dev)
        self._indices_staging = torch.zeros(pages, dtype=torch.int32, device=dev)  # plan() copies it to _indices
        # plan()'s host arrays, pinned once: qo indptr, kv indptr, last page lengths, kv lengths; page indices.
        # Rewritten every plan: safe, as every step ends by reading its results back (a sync)
        pinned = dev.type == "cuda"
        self._host = torch.zeros((4, batch + 1), dtype=torch.int32, pin_memory=pinned)
        self._host_indices = torch.zeros(pages, dtype=torch.int32, pin_memory=pinned)
        self._last = torch.zeros(batch, dtype=torch.int32, device=dev)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            ws,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=self._indptr,
            paged_kv_indptr_buf=self._kv_indptr,
            paged_kv_indices_buf=self._indices,
            paged_kv_last_page_len_buf=self._last,
            backend="fa2",
        )
        self._planned = self._lean = False

    def plan(self, batch: AttnBatch) -> None:
        """Every host array goes through pinned memory, written in place (512 ints: 17 us, against 43 us for
        a new pinned tensor, measured on an H200 host), and the page indices reach the wrapper as a device tensor:
        FlashInfer copies pageable or host indices synchronously (a stream sync), which would make a verify's
        plan wait for the draft graph queued before it (runner/draft_handoff.py)."""
        if self.skip_replan and self._planned:
            return
        first, self._planned = not self._planned, True
        page, b = self.pool.page_size, len(batch.q_lens)
        n_pages = [-(-kv // page) for kv in batch.kv_lens]
        indices = [p for t, n in zip(batch.block_tables, n_pages) for p in t[:n]]
        host, k = self._host.numpy(), len(indices)
        host[0, : b + 1] = list(accumulate(batch.q_lens, initial=0))
        host[1, : b + 1] = list(accumulate(n_pages, initial=0))
        host[2, :b] = [(n - 1) % page + 1 for n in batch.kv_lens]
        host[3, :b] = batch.kv_lens
        self._host_indices.numpy()[:k] = indices
        staged = self._indices_staging[:k]
        staged.copy_(self._host_indices[:k], non_blocking=True)
        h = self._host
        if self._lean:
            rows, max_q, max_kv = sum(batch.q_lens), max(batch.q_lens), max(batch.kv_lens)
            arrays = PlanArrays(h[0, : b + 1], h[1, : b + 1], h[2, :b], h[3, :b], staged, rows, max_q, max_kv)
            lean_plan(self._wrapper, arrays, self.heads, page, batch.causal)
            return
        if first:
            self._check_workspace(sum(batch.q_lens), b)
        dtype = self.pool.k[0].dtype
        self._wrapper.plan(
            h[0, : b + 1],
            h[1, : b + 1],
            staged,
            h[2, :b],
            *self.heads,
            page,
            causal=batch.causal,
            q_data_type=dtype,
            kv_data_type=dtype,
            seq_lens=h[3, :b],  # else FlashInfer derives them into a pageable tensor
        )
        if first:  # the plan that fixed the graph's most rows: lean from here on, where supported
            self._lean = self.use_lean_plan and lean_plan_supported(self._wrapper)

    def _check_workspace(self, rows: int, batch: int) -> None:
        """The first plan fixes the rows every later plan is padded to: refuse one the workspace cannot hold."""
        need = flashinfer_float_workspace_bytes(*self.heads, self._num_sms, graph_rows=rows, graph_batch=batch)
        have = self._workspace_bytes
        if need > have:
            raise UnsupportedConfigError(
                f"a graph wrapper of {batch} requests x {rows} rows at {self.heads} heads may need {need:,} bytes "
                f"of FlashInfer float workspace; it has {have:,} (size it with graph_float_workspace_bytes)"
            )

    def run(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        self._wrapper.run(q, (self.pool.k[layer], self.pool.v[layer]), out=out)
