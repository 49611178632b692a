"""Building blocks shared by the Qwen3 target and the DFlash drafter, written to HF's rounding order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from refengine.config import ModelConfig
from refengine.models.loader import TensorSource


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3RMSNorm: normalise in fp32, cast back, then scale (the order matters in bf16)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rope:
    """Rotate-half (NeoX) RoPE over the full head_dim with a precomputed fp32 cos/sin table."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        freqs = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        self.cos, self.sin = emb.cos(), emb.sin()
        self.max_pos = max_pos

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; positions: [T] absolute positions."""
        cos = self.cos[positions].to(x.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


@dataclass
class DecoderLayerWeights:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [nh*d, H]
    k_proj: torch.Tensor  # [nkv*d, H]
    v_proj: torch.Tensor  # [nkv*d, H]
    o_proj: torch.Tensor  # [H, nh*d]
    q_norm: torch.Tensor  # [d]
    k_norm: torch.Tensor  # [d]
    gate_proj: torch.Tensor  # [I, H]
    up_proj: torch.Tensor  # [I, H]
    down_proj: torch.Tensor  # [H, I]

    @staticmethod
    def names(prefix: str) -> dict[str, str]:
        return {
            "input_norm": f"{prefix}input_layernorm.weight",
            "post_norm": f"{prefix}post_attention_layernorm.weight",
            "q_proj": f"{prefix}self_attn.q_proj.weight",
            "k_proj": f"{prefix}self_attn.k_proj.weight",
            "v_proj": f"{prefix}self_attn.v_proj.weight",
            "o_proj": f"{prefix}self_attn.o_proj.weight",
            "q_norm": f"{prefix}self_attn.q_norm.weight",
            "k_norm": f"{prefix}self_attn.k_norm.weight",
            "gate_proj": f"{prefix}mlp.gate_proj.weight",
            "up_proj": f"{prefix}mlp.up_proj.weight",
            "down_proj": f"{prefix}mlp.down_proj.weight",
        }

    @staticmethod
    def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        return {
            "input_norm": (h,),
            "post_norm": (h,),
            "q_proj": (cfg.q_dim, h),
            "k_proj": (cfg.kv_dim, h),
            "v_proj": (cfg.kv_dim, h),
            "o_proj": (h, cfg.q_dim),
            "q_norm": (d,),
            "k_norm": (d,),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    @classmethod
    def load(cls, src: TensorSource, prefix: str, cfg: ModelConfig, dtype, device) -> DecoderLayerWeights:
        shapes = cls.shapes(cfg)
        return cls(**{k: src.get(n, shapes[k], dtype, device) for k, n in cls.names(prefix).items()})


def project_qkv(w: DecoderLayerWeights, x: torch.Tensor, cfg: ModelConfig, rope: Rope, positions: torch.Tensor):
    """Normed input x [T, H] -> q [T, nh, d], k [T, nkv, d] (q/k-normed per head, then RoPE), v [T, nkv, d]."""
    t = x.shape[0]
    q = rms_norm(F.linear(x, w.q_proj).view(t, cfg.num_heads, cfg.head_dim), w.q_norm, cfg.rms_norm_eps)
    k = rms_norm(F.linear(x, w.k_proj).view(t, cfg.num_kv_heads, cfg.head_dim), w.k_norm, cfg.rms_norm_eps)
    v = F.linear(x, w.v_proj).view(t, cfg.num_kv_heads, cfg.head_dim)
    return rope.apply(q, positions), rope.apply(k, positions), v


def mlp_residual(
    w: DecoderLayerWeights,
    h: torch.Tensor,
    eps: float,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """h + down(silu(gate(n)) * up(n)) with n = post_attention_layernorm(h). `all_reduce`: tensor parallel,
    where down_proj is row-parallel and its partial sums are summed over the ranks."""
    n = rms_norm(h, w.post_norm, eps)
    out = F.linear(F.silu(F.linear(n, w.gate_proj)) * F.linear(n, w.up_proj), w.down_proj)
    return h + (out if all_reduce is None else all_reduce(out))
