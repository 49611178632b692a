"""The fused pre-attention kernel (refengine/models/pre_attn_kernel.py: q/k RMSNorm + RoPE + the K/V write in one
Triton kernel; bf16, marked `gpu`) against the same step as FlashInfer's separate kernels and torch's index_copy.
Shapes: the Qwen3-4B target's heads (32 q, 8 kv, head_dim 128) at 1, 16 and 512 rows, and the drafter's context
rows (k and v only). The pool's written slots must hold equal V, and K and q equal but where the two rsqrt
implementations round a normed value apart (at most 1 in 200 elements, each within the bound RoPE carries that
rounding to: _check_close); every other slot must be untouched. Also replayed from a CUDA graph at new positions
and slots. GPU only: Triton's CPU interpreter rounds to bf16 by
truncation (the kernel's fp32 and fp16 results there equal the separate kernels').

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_pre_attn_kernel.py
The whole GPU suite with the kernel in the engine's forwards (it is opt-in):
    REFENGINE_FUSED_OPS=rmsnorm,add_rmsnorm,silu_and_mul,rope,pre_attn python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import pytest
import torch

from refengine.models.kernels import FlashInferKernels, PreAttnArgs, pre_attn_unfused

pytestmark = pytest.mark.gpu
HQ, HK, D, SLOTS, MAX_POS = 32, 8, 128, 4096, 8192


def _cos_sin() -> torch.Tensor:
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.arange(MAX_POS, device="cuda").float()[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()  # [max_pos, D]


def _case(rows: int, with_q: bool, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    hq = HQ if with_q else 0
    qkv = randn(rows, (hq + 2 * HK) * D, scale=3.0)
    norms = (randn(D, scale=0.2) + 1.0, randn(D, scale=0.2) + 1.0)
    positions = torch.randint(0, MAX_POS, (rows,), generator=g, device="cuda")
    slots = torch.randperm(SLOTS, generator=g, device="cuda")[:rows]
    cache = randn(SLOTS, HK, D), randn(SLOTS, HK, D)
    return qkv, norms, positions, slots, cache


def _args(norms, positions, slots, rows: int, with_q: bool, cache, cos_sin) -> PreAttnArgs:
    q_out = torch.zeros(rows, HQ, D, dtype=torch.bfloat16, device="cuda") if with_q else None
    k_scratch = torch.zeros(rows, HK, D, dtype=torch.bfloat16, device="cuda")
    return PreAttnArgs(norms[0], norms[1], 1e-6, positions, cos_sin, slots, q_out, k_scratch, *cache)


def _check_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """got / want [..., D], normed and rotated. Where the two rsqrt implementations round a normed input one bf16
    step apart, RoPE carries it into both outputs of its rotate-half pair through |cos| + |sin| <= sqrt 2, and
    each side rounds its result once more: at most (sqrt 2 + 1) steps at the pair's norm r (a rotation keeps r,
    and bounds both inputs and outputs by it; r * 2^-7 is at least one bf16 step at r)."""
    half = want.shape[-1] // 2
    w = want.float()
    r = (w[..., :half].square() + w[..., half:].square()).sqrt()
    bound = (2.0**0.5 + 1.0) * torch.cat([r, r], dim=-1) * 2.0**-7
    delta = (got.float() - w).abs()
    off = int((delta > 0).sum())
    over = int((delta > bound).sum())
    assert over == 0 and off <= max(1, got.numel() // 200), (
        f"{name}: {off} of {got.numel()} elements differ ({over} beyond the rounding bound); "
        f"max delta {delta.max().item():.4g}, mean delta {delta.mean().item():.3g}, "
        f"max delta / bound {(delta / bound.clamp_min(1e-30)).max().item():.3g}"
    )


@pytest.mark.parametrize("rows,with_q", [(1, True), (16, True), (512, True), (48, False)])
def test_fused_pre_attn_equals_separate_kernels(rows: int, with_q: bool) -> None:
    kernels, cos_sin = FlashInferKernels(fused_pre_attn=True), _cos_sin()
    qkv, norms, positions, slots, cache = _case(rows, with_q, seed=rows)
    fused = _args(norms, positions, slots, rows, with_q, tuple(c.clone() for c in cache), cos_sin)
    ref = _args(norms, positions, slots, rows, with_q, tuple(c.clone() for c in cache), cos_sin)
    kernels.pre_attn(qkv, fused)
    pre_attn_unfused(kernels, qkv, ref)
    torch.cuda.synchronize()
    if with_q:
        _check_close("q", fused.q_out, ref.q_out)
    _check_close("k at the slots", fused.k_cache[slots], ref.k_cache[slots])
    assert torch.equal(fused.v_cache[slots], ref.v_cache[slots]), "v at the slots differs: a copy must be exact"
    untouched = torch.ones(SLOTS, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    for name, got, orig in (("k", fused.k_cache, cache[0]), ("v", fused.v_cache, cache[1])):
        changed = int((got[untouched] != orig[untouched]).any(-1).any(-1).sum())
        assert changed == 0, f"{name}: {changed} slots outside the written ones changed"


def test_fused_pre_attn_replays_from_a_graph_at_new_positions_and_slots() -> None:
    kernels, cos_sin, rows = FlashInferKernels(fused_pre_attn=True), _cos_sin(), 16
    qkv, norms, positions, slots, cache = _case(rows, True, seed=7)
    fused = _args(norms, positions.clone(), slots.clone(), rows, True, tuple(c.clone() for c in cache), cos_sin)
    static_qkv = qkv.clone()
    kernels.pre_attn(static_qkv, fused)  # warm-up: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.pre_attn(static_qkv, fused)
    qkv2, _, positions2, slots2, _ = _case(rows, True, seed=8)
    static_qkv.copy_(qkv2)
    fused.positions.copy_(positions2)
    fused.slots.copy_(slots2)
    graph.replay()
    ref = _args(norms, positions2, slots2, rows, True, tuple(c.clone() for c in cache), cos_sin)
    pre_attn_unfused(kernels, qkv2, ref)
    torch.cuda.synchronize()
    _check_close("q (replayed)", fused.q_out, ref.q_out)
    _check_close("k at the new slots (replayed)", fused.k_cache[slots2], ref.k_cache[slots2])
    assert torch.equal(fused.v_cache[slots2], ref.v_cache[slots2]), "v at the new slots differs after a replay"
