"""Reference attention: gather each request's pages and run SDPA with an explicit bottom-right causal mask.
Runs on any device; it is the CPU path and the yardstick for the FlashInfer one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refengine.attention.base import AttnBatch


class TorchPagedAttention:
    def __init__(self, pool):
        self.pool = pool
        self._plan: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []

    def prepare(self, batch: AttnBatch) -> None:
        page = self.pool.page_size
        dev = self.pool.k[0].device
        self._plan = []
        row = 0
        for q_len, kv_len, table in zip(batch.q_lens, batch.kv_lens, batch.block_tables):
            pos = torch.arange(kv_len)
            slots = (torch.tensor(table, dtype=torch.int64)[pos // page] * page + pos % page).to(dev)
            q_pos = torch.arange(kv_len - q_len, kv_len)
            mask = (pos[None, :] <= q_pos[:, None]) if batch.causal else torch.ones(q_len, kv_len, dtype=torch.bool)
            mask = mask.to(dev)  # [q, kv]: bottom-right causal, or all keys
            self._plan.append((row, q_len, slots, mask))
            row += q_len

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        kc = self.pool.k[layer].view(-1, *self.pool.k[layer].shape[2:])  # [slots, Hkv, D]
        vc = self.pool.v[layer].view(-1, *self.pool.v[layer].shape[2:])
        out = torch.empty_like(q)
        for row, q_len, slots, mask in self._plan:
            k = kc[slots].transpose(0, 1)  # [Hkv, kv, D]
            v = vc[slots].transpose(0, 1)
            qi = q[row : row + q_len].transpose(0, 1)  # [Hq, q, D]; GQA: kv head = q head // group
            out[row : row + q_len] = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, enable_gqa=True
            ).transpose(0, 1)
        return out
