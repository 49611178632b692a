"""Attention backends behind one protocol: `prepare(batch)` once per forward, `attend(layer, q)` per layer."""

from __future__ import annotations

from refengine.attention.base import AttentionBackend, AttnBatch
from refengine.attention.torch_backend import TorchPagedAttention


def make_backend(name: str, pool, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    if name == "torch":
        return TorchPagedAttention(pool)
    if name == "flashinfer":
        from refengine.attention.flashinfer_backend import FlashInferPagedAttention  # lazy: CPU never needs it

        return FlashInferPagedAttention(pool, num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttnBatch", "TorchPagedAttention", "make_backend"]
