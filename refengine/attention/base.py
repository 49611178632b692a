"""The attention protocol and the batch layout every backend receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttnBatch:
    """A ragged batch: request i contributes q_lens[i] query rows at positions [kv_lens[i]-q_lens[i], kv_lens[i]).

    The rows' K/V are appended to the paged cache (at `slots`) before attention, so kv_lens counts them:
    that is what makes the causal mask bottom-right aligned. `causal=False` (the DFlash drafter's block)
    lets every query row see all kv_lens[i] keys of its request.
    """

    q_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    slots: torch.Tensor  # [T] int64: flat cache slot of each query row's own K/V
    positions: torch.Tensor  # [T] int64 absolute positions
    causal: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class AttentionBackend(Protocol):
    def prepare(self, batch: AttnBatch) -> None:
        """Per-forward planning (index tensors, FlashInfer plan). Called once before the layers run."""

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] -> output [T, Hq, D] over each request's paged KV (causal unless batch.causal is False)."""
