"""FlashInfer paged attention for CUDA (fa2 backend, bf16). One prefill-style wrapper serves prefill, decode
(q_len 1) and verify spans; plan() runs once per forward on host-side index tensors."""

from __future__ import annotations

import torch

from refengine.attention.base import AttnBatch
from refengine.attention.workspace import device_sm_count, flashinfer_float_workspace_bytes
from refengine.errors import UnsupportedConfigError


class FlashInferPagedAttention:
    def __init__(self, pool, num_heads: int, num_kv_heads: int, head_dim: int):
        try:
            import flashinfer
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise UnsupportedConfigError(
                "attention_backend='flashinfer' needs flashinfer-python 0.6.3 (pip install '.[gpu]')"
            ) from e
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        device = pool.k[0].device
        # an eager plan splits the KV over at most 2 CTAs per SM, whatever its rows (attention/workspace.py)
        nbytes = flashinfer_float_workspace_bytes(num_heads, num_kv_heads, head_dim, device_sm_count(device))
        self._workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")

    def prepare(self, batch: AttnBatch) -> None:
        page = self.pool.page_size
        n_pages = [-(-kv // page) for kv in batch.kv_lens]
        qo_indptr = torch.tensor([0] + batch.q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv_indptr = torch.tensor([0] + n_pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        indices = torch.tensor(
            [b for t, n in zip(batch.block_tables, n_pages) for b in t[:n]],
            dtype=torch.int32,
            device=self.pool.k[0].device,
        )
        last = torch.tensor([(kv - 1) % page + 1 for kv in batch.kv_lens], dtype=torch.int32)
        self._wrapper.plan(
            qo_indptr,
            kv_indptr,
            indices,
            last,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            page,
            causal=batch.causal,
            q_data_type=self.pool.k[0].dtype,
            kv_data_type=self.pool.k[0].dtype,
        )

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q.contiguous(), (self.pool.k[layer], self.pool.v[layer]))
