"""The Qwen3 target: loads an HF checkpoint by HF parameter names and runs ragged batches over the paged KV.

Each decoder layer is split into pre_attn (norm, qkv, q/k norm, RoPE, KV append) / attn / post_attn
(o-proj, residual, MLP) so the verify forward can be cut into dense segments around attention.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from refengine.config import ModelConfig, read_config_json
from refengine.errors import CheckpointError
from refengine.models.layers import DecoderLayerWeights, Rope, mlp_residual, project_qkv, rms_norm
from refengine.models.loader import tensor_source


class Qwen3Model:
    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[DecoderLayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
    ):
        self.cfg = cfg
        self.embed_tokens = embed  # [V, H]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # [V, H]; the same tensor as embed_tokens when tied
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, embed.device)
        # Tensor parallel (refengine/parallel): cfg is then this rank's geometry;
        # all_reduce sums the row-parallel partial outputs (o_proj, down_proj) over the ranks.
        self.tp_size = 1
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        synthetic: bool = False,
    ) -> Qwen3Model:
        """Load by HF names; synthetic=True draws seeded random weights from config.json alone."""
        raw = read_config_json(path)
        cfg = ModelConfig.from_hf(raw)
        src = tensor_source(path, synthetic)
        device = torch.device(device)
        h, v = cfg.hidden_size, cfg.vocab_size
        # Tied checkpoints (Qwen3-4B) store no lm_head; some tied exports store a copy anyway (ignored, as HF
        # does). Untied ones must store it: tying it silently would decode with the wrong head.
        if not cfg.tie_word_embeddings and not synthetic and not src.has("lm_head.weight"):
            raise CheckpointError(
                f"checkpoint {path}: config.json has tie_word_embeddings "
                f"{'false' if raw.get('tie_word_embeddings') is not None else 'absent (false, as HF)'} but no tensor "
                f"'lm_head.weight' (expected shape {[v, h]}); set tie_word_embeddings true if the head is the "
                f"embedding"
            )
        embed = src.get("model.embed_tokens.weight", (v, h), dtype, device)
        layers = [
            DecoderLayerWeights.load(src, f"model.layers.{i}.", cfg, dtype, device) for i in range(cfg.num_layers)
        ]
        norm = src.get("model.norm.weight", (h,), dtype, device)
        lm_head = embed if cfg.tie_word_embeddings else src.get("lm_head.weight", (v, h), dtype, device)
        expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        for i in range(cfg.num_layers):
            expected |= set(DecoderLayerWeights.names(f"model.layers.{i}.").values())
        src.check_no_extra(expected, ignore_prefixes=("model.rotary_emb",))
        return cls(cfg, embed, layers, norm, lm_head)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    # ---- the three pieces of a decoder layer ------------------------------------------------------------
    def pre_attn(self, i: int, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool) -> torch.Tensor:
        """h [T, H] -> q [T, nh, d]; appends this layer's K/V for the T rows at `slots`."""
        w = self.layers[i]
        q, k, v = project_qkv(w, rms_norm(h, w.input_norm, self.cfg.rms_norm_eps), self.cfg, self.rope, positions)
        pool.k[i].view(-1, self.cfg.num_kv_heads, self.cfg.head_dim)[slots] = k
        pool.v[i].view(-1, self.cfg.num_kv_heads, self.cfg.head_dim)[slots] = v
        return q

    def post_attn(self, i: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o-proj, then the MLP block. attn_out [T, nh, d]."""
        w = self.layers[i]
        o = F.linear(attn_out.reshape(h.shape[0], -1), w.o_proj)
        h = h + (o if self.all_reduce is None else self.all_reduce(o))
        return mlp_residual(w, h, self.cfg.rms_norm_eps, self.all_reduce)

    def forward(
        self, token_ids: torch.Tensor, batch, pool, attention, capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T ragged rows. Returns (final hidden [T, H] after the final norm, captured features
        [T, len(capture_layers) * H] or None). Captured id L is the output of layer L (HF hidden_states[L+1])."""
        attention.prepare(batch)
        h = self.embed_tokens[token_ids]
        captured: dict[int, torch.Tensor] = {}
        for i in range(self.cfg.num_layers):
            q = self.pre_attn(i, h, batch.positions, batch.slots, pool)
            h = self.post_attn(i, h, attention.attend(i, q))
            if i in capture_layers:
                captured[i] = h
        feats = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return rms_norm(h, self.final_norm, self.cfg.rms_norm_eps), feats

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Normed hidden [R, H] -> logits [R, V] (fp32, or the model dtype for an argmax without a copy)."""
        logits = F.linear(hidden, self.lm_head)
        return logits.float() if fp32 else logits
