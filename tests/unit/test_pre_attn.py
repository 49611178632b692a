"""The pre-attention step behind `Kernels.pre_attn` (refengine/models/kernels.py) on the CPU, fp32: the separate
ops (q/k RMSNorm, RoPE, the K/V write) equal the HF-order layer math of models/layers.py (rms_norm, Rope.apply) at
the written slots, leave every other slot untouched, and with no q heads (the drafter's context rows) write K/V
only. Also which kernels a config selects: pre_attn is opt-in, unknown ops are refused. The fused Triton kernel
itself is checked on a GPU (tests/gpu/test_gpu_pre_attn_kernel.py).

Run: python -m pytest tests/unit/test_pre_attn.py
"""

from __future__ import annotations

import pytest
import torch

from refengine.config import DEFAULT_FUSED_OPS, EngineConfig
from refengine.errors import UnsupportedConfigError
from refengine.models.kernels import PreAttnArgs, TorchKernels, kernels_for
from refengine.models.layers import Rope, rms_norm

HQ, HK, D, SLOTS, EPS = 4, 2, 16, 40, 1e-6


def _run(rows: int, with_q: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    hq = HQ if with_q else 0
    qkv = torch.randn(rows, (hq + 2 * HK) * D, generator=g) * 3
    q_norm, k_norm = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    rope = Rope(D, 1e6, 256, torch.device("cpu"))
    cos_sin = torch.cat([rope.cos[:, : D // 2], rope.sin[:, : D // 2]], dim=-1).contiguous()
    positions = torch.randint(0, 256, (rows,), generator=g)
    slots = torch.randperm(SLOTS, generator=g)[:rows]
    k_cache, v_cache = torch.randn(SLOTS, HK, D, generator=g), torch.randn(SLOTS, HK, D, generator=g)
    before = k_cache.clone(), v_cache.clone()
    q_out = torch.zeros(rows, HQ, D) if with_q else None
    args = PreAttnArgs(
        q_norm, k_norm, EPS, positions, cos_sin, slots, q_out, torch.zeros(rows, HK, D), k_cache, v_cache
    )
    TorchKernels().pre_attn(qkv, args)
    q, k, v = qkv.split([hq * D, HK * D, HK * D], dim=-1)
    want_k = rope.apply(rms_norm(k.reshape(rows, HK, D), k_norm, EPS), positions)
    want_q = rope.apply(rms_norm(q.reshape(rows, HQ, D), q_norm, EPS), positions) if with_q else None
    return args, slots, before, want_q, want_k, v.reshape(rows, HK, D)


@pytest.mark.parametrize("with_q", [True, False], ids=["q-k-v", "context-k-v"])
def test_pre_attn_equals_layer_math_and_writes_only_its_slots(with_q: bool) -> None:
    args, slots, (k_before, v_before), want_q, want_k, want_v = _run(7, with_q, seed=3)
    if with_q:
        assert args.q_out is not None
        dq = (args.q_out - want_q).abs().max().item()
        assert dq < 1e-5, f"q max delta {dq:.3g} against rms_norm + Rope.apply"
    dk = (args.k_cache[slots] - want_k).abs().max().item()
    assert dk < 1e-5, f"k at the slots: max delta {dk:.3g} against rms_norm + Rope.apply"
    assert torch.equal(args.v_cache[slots], want_v), "v at the slots is not the v rows copied"
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[slots] = False
    moved = int((args.k_cache[others] != k_before[others]).any(-1).any(-1).sum())
    moved += int((args.v_cache[others] != v_before[others]).any(-1).any(-1).sum())
    assert moved == 0, f"{moved} K/V slots outside the written ones changed"


def test_fused_ops_selection() -> None:
    cfg = EngineConfig("unused-path")
    assert cfg.fused_ops_names == DEFAULT_FUSED_OPS and "pre_attn" not in DEFAULT_FUSED_OPS
    assert EngineConfig("unused-path", fused_ops=(*DEFAULT_FUSED_OPS, "pre_attn")).fused_ops_names[-1] == "pre_attn"
    with pytest.raises(UnsupportedConfigError, match="fused_ops"):
        EngineConfig("unused-path", fused_ops=("pre_attention",))
    assert isinstance(kernels_for(torch.device("cpu"), frozenset({"pre_attn"})), TorchKernels)
