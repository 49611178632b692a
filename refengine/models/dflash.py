"""The DFlash drafter (z-lab checkpoint format): a Qwen3-style stack with no embedding and no LM head.

Context rows (target features at the tap layers) are fused by fc -> hidden_norm and injected as extra K/V in
every layer (k_proj -> k_norm -> RoPE, v_proj). A block [current, MASK x (B-1)] attends non-causally over
[context ; block]; rows 1..B-1 go through the final norm and the target's lm_head: same-position drafts.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from refengine.config import DFlashConfig, read_config_json
from refengine.errors import UnsupportedConfigError
from refengine.models.layers import DecoderLayerWeights, Rope, mlp_residual, project_qkv, rms_norm
from refengine.models.loader import tensor_source
from refengine.models.qwen3 import Qwen3Model


class DFlashDrafter:
    def __init__(self, cfg: DFlashConfig, fc: torch.Tensor, hidden_norm: torch.Tensor,
                 layers: list[DecoderLayerWeights], norm: torch.Tensor, target: Qwen3Model):
        self.cfg = cfg
        self.mcfg = cfg.model
        self.fc = fc                    # [H, F*H]
        self.hidden_norm = hidden_norm  # [H]
        self.layers = layers
        self.norm = norm                # [H]
        self.embed_tokens = target.embed_tokens  # shared with the target, frozen
        self.lm_head = target.lm_head
        self.rope = Rope(self.mcfg.head_dim, self.mcfg.rope_theta, self.mcfg.max_position_embeddings, fc.device)

    @classmethod
    def load(cls, path: str | Path, target: Qwen3Model, synthetic: bool = False) -> DFlashDrafter:
        cfg = DFlashConfig.from_hf(read_config_json(path))
        cfg.check_fits(target.cfg)
        m = cfg.model
        if m.head_dim != target.cfg.head_dim:
            # not required by the maths, but every published pair shares it and the kernels assume it
            raise UnsupportedConfigError(
                f"drafter does not fit its target: head_dim {m.head_dim} != target {target.cfg.head_dim}")
        src = tensor_source(path, synthetic)
        dtype, device = target.dtype, target.device
        h, nf = m.hidden_size, len(cfg.target_layer_ids)
        fc = src.get("fc.weight", (h, nf * h), dtype, device)
        hn = src.get("hidden_norm.weight", (h,), dtype, device)
        norm = src.get("norm.weight", (h,), dtype, device)
        layers = [DecoderLayerWeights.load(src, f"layers.{i}.", m, dtype, device) for i in range(m.num_layers)]
        expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
        for i in range(m.num_layers):
            expected |= set(DecoderLayerWeights.names(f"layers.{i}.").values())
        src.check_no_extra(expected, ignore_prefixes=("rotary_emb",))
        return cls(cfg, fc, hn, layers, norm, target)

    @property
    def feature_width(self) -> int:
        return len(self.cfg.target_layer_ids) * self.mcfg.hidden_size

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target features [R, F*H] at absolute positions [R] -> per layer (K [R, nkv, d] roped, V [R, nkv, d]).

        A pure function of (features, position): computed once per committed token and cached for ever."""
        m = self.mcfg
        c = rms_norm(F.linear(feats, self.fc), self.hidden_norm, m.rms_norm_eps)  # [R, H]
        out = []
        for w in self.layers:
            k = rms_norm(F.linear(c, w.k_proj).view(-1, m.num_kv_heads, m.head_dim), w.k_norm, m.rms_norm_eps)
            v = F.linear(c, w.v_proj).view(-1, m.num_kv_heads, m.head_dim)
            out.append((self.rope.apply(k, positions), v))
        return out

    def draft_logits(self, block_tokens: torch.Tensor, positions: torch.Tensor,
                     kv_buffers: list[list[tuple[torch.Tensor, torch.Tensor]]], ctx_lens: list[int],
                     fp32: bool = True) -> torch.Tensor:
        """N blocks of B rows. block_tokens/positions: [N*B]. kv_buffers[i][layer] = (K, V) buffers
        [>= ctx_lens[i] + B, nkv, d] holding request i's context K/V in rows [0, ctx_lens[i]).

        The block's own K/V are written into rows [ctx_len, ctx_len + B) of those buffers, so attention
        reads one contiguous view with no copy; they are scratch (never part of the context): the next
        committed context rows overwrite them. Dense ops run once over all N*B rows; only attention loops per
        request. Returns logits [N, B-1, V] for block rows 1..B-1 (row j predicts position start + j), in
        fp32 or (fp32=False, argmax without an fp32 copy of the largest buffer) in the model dtype."""
        m, b = self.mcfg, self.cfg.block_size
        n = block_tokens.shape[0] // b
        group = m.num_heads // m.num_kv_heads
        h = self.embed_tokens[block_tokens]  # [N*B, H]
        for li, w in enumerate(self.layers):
            q, kb, vb = project_qkv(w, rms_norm(h, w.input_norm, m.rms_norm_eps), m, self.rope, positions)
            attn = torch.empty_like(q)  # [N*B, nh, d]
            for i in range(n):
                rows, end = slice(i * b, (i + 1) * b), ctx_lens[i] + b
                kbuf, vbuf = kv_buffers[i][li]
                kbuf[ctx_lens[i]:end] = kb[rows]
                vbuf[ctx_lens[i]:end] = vb[rows]
                # Non-causal, so rows are independent: fold each kv head's g query heads into its rows and
                # run plain multi-head attention over [nkv, g*B, d] (GQA with no K/V expansion on any backend).
                qg = q[rows].view(b, m.num_kv_heads, group, m.head_dim).permute(1, 2, 0, 3)
                o = F.scaled_dot_product_attention(qg.reshape(m.num_kv_heads, group * b, m.head_dim),
                                                   kbuf[:end].transpose(0, 1), vbuf[:end].transpose(0, 1))
                attn[rows] = o.view(m.num_kv_heads, group, b, m.head_dim).permute(2, 0, 1, 3).reshape(
                    b, m.num_heads, m.head_dim)
            h = h + F.linear(attn.reshape(n * b, -1), w.o_proj)
            h = mlp_residual(w, h, m.rms_norm_eps)
        z = rms_norm(h.view(n, b, -1)[:, 1:], self.norm, m.rms_norm_eps)  # [N, B-1, H]
        logits = F.linear(z, self.lm_head)
        return logits.float() if fp32 else logits
