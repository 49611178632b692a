"""The dense kernels of the graphed forwards, behind one small interface: FlashInfer's fused CUDA kernels
(bf16), or plain torch ops written to HF's rounding order (any device: the CPU tests of the graph runner).

Every op writes into a caller-owned buffer or in place, so a captured CUDA graph sees stable addresses.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from refengine.config import FUSED_OPS


class Kernels(Protocol):
    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        """out = norm(x) * weight over the last dim; x [R, D] or [R, heads, D] (last dim contiguous)."""

    def fused_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: residual += x, then x = norm(residual) * weight. x, residual [R, D]."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[R, 2I] ([gate; up]) -> silu(gate) * up [R, I]."""

    def rope_inplace(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int, cos_sin: torch.Tensor
    ) -> None:
        """Rotate-half RoPE in place on q [R, Hq, D] and k [R, Hk, D]; cos_sin [max_pos, D] fp32 holds cos in
        its first half and sin in its second."""


class TorchKernels:
    """Reference implementations (HF rounding order: normalise in fp32, cast, then scale)."""

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        xf = x.float()
        out.copy_(weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))

    def fused_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        residual.add_(x)
        self.rmsnorm(residual, weight, eps, out=x)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_inplace(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int, cos_sin: torch.Tensor
    ) -> None:
        half = head_dim // 2
        cos = cos_sin[positions, :half].repeat(1, 2).to(q.dtype)[:, None, :]  # [R, 1, D], as HF casts
        sin = cos_sin[positions, half:].repeat(1, 2).to(q.dtype)[:, None, :]
        for x in (q, k):
            rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
            x.copy_(x * cos + rotated * sin)


class FlashInferKernels:
    """FlashInfer 0.6.3 fused kernels (CUDA, bf16/fp16 only; norm weights in the activation dtype)."""

    def __init__(self) -> None:
        import flashinfer  # lazily: CPU installs never need it

        self._fi = flashinfer

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        self._fi.rmsnorm(x, weight, eps=eps, out=out)

    def fused_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        self._fi.fused_add_rmsnorm(x, residual, weight, eps=eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fi.silu_and_mul(gate_up)

    def rope_inplace(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int, cos_sin: torch.Tensor
    ) -> None:
        self._fi.apply_rope_with_cos_sin_cache_inplace(
            positions, q.view(q.shape[0], -1), k.view(k.shape[0], -1), head_dim, cos_sin, is_neox=True
        )


class MixedKernels:
    """FlashInfer for the ops named in `fused`, torch for the rest (to measure what each fused kernel pays)."""

    def __init__(self, fused: frozenset[str]):
        fi, ref = FlashInferKernels(), TorchKernels()
        self.rmsnorm = (fi if "rmsnorm" in fused else ref).rmsnorm
        self.fused_add_rmsnorm = (fi if "add_rmsnorm" in fused else ref).fused_add_rmsnorm
        self.silu_and_mul = (fi if "silu_and_mul" in fused else ref).silu_and_mul
        self.rope_inplace = (fi if "rope" in fused else ref).rope_inplace


def kernels_for(device: torch.device, fused: frozenset[str]) -> Kernels:
    """FlashInfer's kernels for the `fused` ops on CUDA (bf16 / fp16 only), the torch reference ops otherwise."""
    if device.type != "cuda" or not fused:
        return TorchKernels()
    return FlashInferKernels() if fused >= set(FUSED_OPS) else MixedKernels(fused)
