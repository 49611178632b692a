"""The DFlash drafter (z-lab checkpoint format): a Qwen3-style stack with no embedding and no LM head.

Context rows (target features at the tap layers) are fused by fc -> hidden_norm and injected as extra K/V in
every layer (k_proj -> k_norm -> RoPE, v_proj). A block [current, MASK x (B-1)] attends non-causally over
[context ; block]; rows 1..B-1 go through the final norm and the target's lm_head: same-position drafts.
Context and block K/V live in a paged pool (refengine.kv.KvPool) of the drafter's own geometry, so one
attention backend call serves a whole batch of requests (torch on the CPU, FlashInfer on CUDA).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from refengine.attention.base import AttentionBackend, AttnBatch
from refengine.config import DFlashConfig, read_config_json
from refengine.kv.pool import KvPool
from refengine.models.layers import DecoderLayerWeights, Rope, mlp_residual, project_qkv, rms_norm
from refengine.models.loader import tensor_source
from refengine.models.qwen3 import Qwen3Model


class DFlashDrafter:
    def __init__(
        self,
        cfg: DFlashConfig,
        fc: torch.Tensor,
        hidden_norm: torch.Tensor,
        layers: list[DecoderLayerWeights],
        norm: torch.Tensor,
        target: Qwen3Model,
    ):
        self.cfg = cfg
        self.mcfg = cfg.model
        self.fc = fc  # [H, F*H]
        self.hidden_norm = hidden_norm  # [H]
        self.layers = layers
        self.norm = norm  # [H]
        self.embed_tokens = target.embed_tokens  # shared with the target, frozen
        self.lm_head = target.lm_head
        self.rope = Rope(self.mcfg.head_dim, self.mcfg.rope_theta, self.mcfg.max_position_embeddings, fc.device)

    @classmethod
    def load(cls, path: str | Path, target: Qwen3Model, synthetic: bool = False) -> DFlashDrafter:
        cfg = DFlashConfig.from_hf(read_config_json(path))
        cfg.check_fits(target.cfg)
        m = cfg.model
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

    def draft_logits(
        self, block_tokens: torch.Tensor, batch: AttnBatch, pool: KvPool, attention: AttentionBackend, fp32: bool = True
    ) -> torch.Tensor:
        """N blocks of B rows: block_tokens [N*B] at batch.positions, each request's context K/V already in
        `pool` at positions [0, start). The block's own K/V are written at batch.slots (positions
        [start, start + B), the request's scratch rows past its context: the next committed context rows
        overwrite them) and attention is non-causal over [context ; block] (batch.causal is False).
        Dense ops run once over all N*B rows; attention is one backend call per layer. Returns logits
        [N, B-1, V] for block rows 1..B-1 (row j predicts position start + j), in fp32 or (fp32=False,
        argmax without an fp32 copy of the largest buffer) in the model dtype."""
        m, b = self.mcfg, self.cfg.block_size
        n = block_tokens.shape[0] // b
        attention.prepare(batch)
        h = self.embed_tokens[block_tokens]  # [N*B, H]
        for li, w in enumerate(self.layers):
            q, kb, vb = project_qkv(w, rms_norm(h, w.input_norm, m.rms_norm_eps), m, self.rope, batch.positions)
            pool.k[li].view(-1, m.num_kv_heads, m.head_dim)[batch.slots] = kb
            pool.v[li].view(-1, m.num_kv_heads, m.head_dim)[batch.slots] = vb
            h = h + F.linear(attention.attend(li, q).reshape(n * b, -1), w.o_proj)
            h = mlp_residual(w, h, m.rms_norm_eps)
        z = rms_norm(h.view(n, b, -1)[:, 1:], self.norm, m.rms_norm_eps)  # [N, B-1, H]
        logits = F.linear(z, self.lm_head)
        return logits.float() if fp32 else logits
