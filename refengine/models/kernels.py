"""The dense kernels of the graphed forwards, behind one small interface: FlashInfer's fused CUDA kernels
(bf16) plus one Triton kernel for the step between the QKV GEMM and attention (models/pre_attn_kernel.py), or
plain torch ops written to HF's rounding order (any device: the CPU tests of the graph runner).

Every op writes into a caller-owned buffer or in place, so a captured CUDA graph sees stable addresses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from refengine.config import FUSED_OPS
from refengine.errors import UnsupportedConfigError


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

    def pre_attn(self, qkv: torch.Tensor, w: PreAttnArgs) -> None:
        """qkv [R, (Hq + 2 Hk) D] -> q normed and rotated into w.q_out [R, Hq, D] (None: no q heads), k normed,
        rotated and written with v at w.slots into w.k_cache / w.v_cache [slots, Hk, D]."""


@dataclass(frozen=True)
class PreAttnArgs:
    """What one pre-attention step reads and writes besides the QKV rows."""

    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    eps: float
    positions: torch.Tensor  # [R] int64
    cos_sin: torch.Tensor  # [max_pos, D] fp32
    slots: torch.Tensor  # [R] int64
    q_out: torch.Tensor | None  # [R, Hq, D]
    k_scratch: torch.Tensor  # [R, Hk, D]: the normed k before its write (unfused paths only)
    k_cache: torch.Tensor  # [slots, Hk, D]
    v_cache: torch.Tensor  # [slots, Hk, D]


def pre_attn_unfused(kernels: Kernels, qkv: torch.Tensor, w: PreAttnArgs) -> None:
    """The pre-attention step as separate kernels: q norm, k norm, RoPE, the K and V writes."""
    rows, hk, d = qkv.shape[0], w.k_cache.shape[1], w.k_cache.shape[2]
    hq = 0 if w.q_out is None else w.q_out.shape[1]
    q_out = w.q_out if w.q_out is not None else w.k_scratch.new_empty(rows, 1, d)  # RoPE rotates a q per k row
    if w.q_out is not None:
        kernels.rmsnorm(qkv[:, : hq * d].view(rows, hq, d), w.q_norm, w.eps, out=q_out)
    kernels.rmsnorm(qkv[:, hq * d : (hq + hk) * d].view(rows, hk, d), w.k_norm, w.eps, out=w.k_scratch)
    kernels.rope_inplace(w.positions, q_out, w.k_scratch, d, w.cos_sin)
    w.k_cache.index_copy_(0, w.slots, w.k_scratch)
    w.v_cache.index_copy_(0, w.slots, qkv[:, (hq + hk) * d :].view(rows, hk, d))


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

    def pre_attn(self, qkv: torch.Tensor, w: PreAttnArgs) -> None:
        pre_attn_unfused(self, qkv, w)


class FlashInferKernels:
    """FlashInfer 0.6.3 fused kernels (CUDA, bf16/fp16 only; norm weights in the activation dtype) and, with
    `fused_pre_attn`, the Triton pre-attention kernel (else the pre-attention step runs as FlashInfer's
    separate kernels)."""

    def __init__(self, fused_pre_attn: bool = False) -> None:
        import flashinfer  # lazily: CPU installs never need it

        self._fi, self._pre_attn_fused = flashinfer, None
        if fused_pre_attn:
            try:
                from refengine.models.pre_attn_kernel import pre_attn_fused  # Triton: ships with CUDA torch builds
            except ImportError as e:
                raise UnsupportedConfigError(
                    f"the fused pre_attn kernel needs Triton ({e}); install it, or leave pre_attn out of fused_ops"
                ) from e
            self._pre_attn_fused = pre_attn_fused

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

    def pre_attn(self, qkv: torch.Tensor, w: PreAttnArgs) -> None:
        if self._pre_attn_fused is None:
            pre_attn_unfused(self, qkv, w)
            return
        self._pre_attn_fused(
            qkv, w.q_norm, w.k_norm, w.eps, w.positions, w.cos_sin, w.slots, w.q_out, w.k_cache, w.v_cache
        )


class MixedKernels:
    """The fused kernels for the ops named in `fused`, torch for the rest (to measure what each fused kernel pays).
    Without "pre_attn" the pre-attention step runs as separate kernels, each fused or not as named."""

    def __init__(self, fused: frozenset[str]):
        fi, ref = FlashInferKernels(fused_pre_attn="pre_attn" in fused), TorchKernels()
        self.rmsnorm = (fi if "rmsnorm" in fused else ref).rmsnorm
        self.fused_add_rmsnorm = (fi if "add_rmsnorm" in fused else ref).fused_add_rmsnorm
        self.silu_and_mul = (fi if "silu_and_mul" in fused else ref).silu_and_mul
        self.rope_inplace = (fi if "rope" in fused else ref).rope_inplace
        self._fused_pre_attn = fi.pre_attn if "pre_attn" in fused else None

    def pre_attn(self, qkv: torch.Tensor, w: PreAttnArgs) -> None:
        if self._fused_pre_attn is not None:
            self._fused_pre_attn(qkv, w)
        else:
            pre_attn_unfused(self, qkv, w)


def kernels_for(device: torch.device, fused: frozenset[str]) -> Kernels:
    """The fused kernels for the `fused` ops on CUDA (bf16 / fp16 only), the torch reference ops otherwise."""
    if device.type != "cuda" or not fused:
        return TorchKernels()
    if fused >= set(FUSED_OPS) - {"pre_attn"}:  # every FlashInfer op
        return FlashInferKernels(fused_pre_attn="pre_attn" in fused)
    return MixedKernels(fused)
