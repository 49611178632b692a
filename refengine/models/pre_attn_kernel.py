"""One Triton kernel for everything between the QKV GEMM and attention: per-head RMSNorm of q and k, RoPE on
both, and the K/V write into the paged pool at each row's slot.

Why: done as separate kernels (q norm, k norm, RoPE, K copy, V copy) that is five launches per layer, each too
small to fill the GPU; at batch 1 their launch-to-launch gaps cost more than their work. One program handles one
head of one row: q heads go to `q_out`, k heads to the pool's K, v heads (copied as they are) to its V.

Rounding: the same points as FlashInfer's separate kernels (the norm in fp32 with the weight, rounded to the
activation dtype; RoPE in fp32 on the rounded values, rounded again), so the fused step equals the unfused one
up to fp32 operation order. tests/gpu/test_gpu_pre_attn_kernel.py compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pre_attn_kernel(
    qkv_ptr,  # [R, (NQ + 2 NKV) * D] row-major, rows `qkv_stride` apart
    qkv_stride,
    q_norm_ptr,  # [D]
    k_norm_ptr,  # [D]
    positions_ptr,  # [R] int64
    cos_sin_ptr,  # [max_pos, D] fp32: cos in the first half, sin in the second
    slots_ptr,  # [R] int64: pool slot of each row
    q_out_ptr,  # [R, NQ, D]
    k_cache_ptr,  # [slots, NKV, D]
    v_cache_ptr,  # [slots, NKV, D]
    eps,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,  # D // 2
):
    row = tl.program_id(0)
    head = tl.program_id(1)  # 0..NQ+2NKV-1: q heads, then k heads, then v heads
    offs = tl.arange(0, HALF)
    src = qkv_ptr + row * qkv_stride + head * D
    x1 = tl.load(src + offs).to(tl.float32)  # the rotate-half pairs: x1[j] with x2[j]
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    slot = tl.load(slots_ptr + row)
    out_ty = q_out_ptr.dtype.element_ty
    if head >= NQ + NKV:
        dst = v_cache_ptr + (slot * NKV + (head - NQ - NKV)) * D
        tl.store(dst + offs, x1.to(out_ty))
        tl.store(dst + HALF + offs, x2.to(out_ty))
    else:
        if head < NQ:
            w_ptr = q_norm_ptr
            dst = q_out_ptr + (row * NQ + head) * D
        else:
            w_ptr = k_norm_ptr
            dst = k_cache_ptr + (slot * NKV + (head - NQ)) * D
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        n1 = (x1 * rstd * tl.load(w_ptr + offs).to(tl.float32)).to(out_ty).to(tl.float32)
        n2 = (x2 * rstd * tl.load(w_ptr + HALF + offs).to(tl.float32)).to(out_ty).to(tl.float32)
        pos = tl.load(positions_ptr + row)
        cos = tl.load(cos_sin_ptr + pos * D + offs)
        sin = tl.load(cos_sin_ptr + pos * D + HALF + offs)
        tl.store(dst + offs, (n1 * cos - n2 * sin).to(out_ty))
        tl.store(dst + HALF + offs, (n2 * cos + n1 * sin).to(out_ty))


def pre_attn_fused(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slots: torch.Tensor,
    q_out: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """qkv [R, (nq + 2 nkv) d] -> q_out [R, nq, d] (None when nq is 0: the drafter's context rows) and the
    pool's k_cache / v_cache [slots, nkv, d] at `slots`."""
    rows = qkv.shape[0]
    nkv, d = k_cache.shape[1], k_cache.shape[2]
    nq = 0 if q_out is None else q_out.shape[1]
    if qkv.shape[1] != (nq + 2 * nkv) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} (strides {qkv.stride()}) is not [rows, ({nq} + 2*{nkv}) * {d}]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and (q_out is None or q_out.is_contiguous())):
        raise ValueError("q_out, k_cache and v_cache must be contiguous")
    if rows == 0:
        return
    _pre_attn_kernel[(rows, nq + 2 * nkv)](
        qkv,
        qkv.stride(0),
        q_norm,
        k_norm,
        positions,
        cos_sin,
        slots,
        k_cache if q_out is None else q_out,  # only its dtype is read when there are no q heads
        k_cache,
        v_cache,
        eps,
        NQ=nq,
        NKV=nkv,
        D=d,
        HALF=d // 2,
        num_warps=1,
    )
