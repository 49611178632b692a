"""Attention for one captured graph shape: a fixed batch of `batch` requests (real ones first, then padding
requests on the pool's dummy pages), planned on the host before every replay.

- FlashInfer (CUDA): a `BatchPrefillWithPagedKVCacheWrapper` in CUDA-graph mode with persistent index
  buffers. plan() rewrites those buffers and the wrapper's work lists; the captured kernel reads them at run
  time, so a graph captured at one KV length replays correctly at any other. Its first plan fixes the most
  query rows it may ever see: the shape's full row count.
- Torch (any device): the reference backend re-prepared each step (the CPU tests of the graph runner).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from refengine.attention.base import AttnBatch
from refengine.attention.torch_backend import TorchPagedAttention
from refengine.kv.pool import KvPool

FLOAT_WORKSPACE_BYTES = 256 * 1024 * 1024  # split-KV partial outputs; shared by every wrapper of a device


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

    def __init__(self, pool: KvPool, batch: int, num_heads: int, num_kv_heads: int, head_dim: int):
        import flashinfer  # lazily: CPU installs never need it

        dev = pool.k[0].device
        ws = self._workspaces.get(dev)
        if ws is None:
            ws = self._workspaces[dev] = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        pages = pool.k[0].shape[0]
        self.pool, self.heads = pool, (num_heads, num_kv_heads, head_dim)
        self._indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self._kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self._indices = torch.zeros(pages, dtype=torch.int32, device=dev)
        self._indices_staging = torch.zeros(pages, dtype=torch.int32, device=dev)  # plan() copies it to _indices
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
        self._planned = False

    def plan(self, batch: AttnBatch) -> None:
        """Every host array goes through pinned memory and the page indices reach the wrapper as a device
        tensor: FlashInfer copies pageable or host indices synchronously (a stream sync), which would make a
        verify's plan wait for the draft graph queued before it (runner/model_runner.py's hand-off)."""
        if self.skip_replan and self._planned:
            return
        self._planned = True
        page = self.pool.page_size
        n_pages = [-(-kv // page) for kv in batch.kv_lens]
        pinned = self._indices.is_cuda

        def host(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, pin_memory=pinned)

        qo = host(list(accumulate(batch.q_lens, initial=0)))
        kv = host(list(accumulate(n_pages, initial=0)))
        indices = host([b for t, n in zip(batch.block_tables, n_pages) for b in t[:n]])
        staged = self._indices_staging[: indices.shape[0]]
        staged.copy_(indices, non_blocking=True)
        last = host([(n - 1) % page + 1 for n in batch.kv_lens])
        dtype = self.pool.k[0].dtype
        self._wrapper.plan(
            qo,
            kv,
            staged,
            last,
            *self.heads,
            page,
            causal=batch.causal,
            q_data_type=dtype,
            kv_data_type=dtype,
            seq_lens=host(list(batch.kv_lens)),  # else FlashInfer derives them into a pageable tensor
        )

    def run(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        self._wrapper.run(q, (self.pool.k[layer], self.pool.v[layer]), out=out)
