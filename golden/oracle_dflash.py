"""A slow, dense, one-request DFlash drafter and speculative loop, straight from the DFlash drafter
specification (z-lab's reference: context K/V injection, the non-causal block, the speculative loop).

Nothing is cached between calls: every draft recomputes the context K/V from the full context features,
and every verify recomputes the target densely with HF. That makes the oracle obviously a pure function
of its inputs, which is the point: it is the thing a fast engine's drafter is compared against.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from golden import hf_reference


def read_safetensors(model_dir: str | Path, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint dir (model.safetensors, or shards listed by model.safetensors.index.json);
    only `names` when given. A missing name raises KeyError naming the directory."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    wanted = list(weight_map) if names is None else list(names)
    missing = [n for n in wanted if n not in weight_map]
    if missing:
        raise KeyError(f"{model_dir}: tensors not in checkpoint: {missing}")
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        by_file.setdefault(weight_map[n], []).append(n)
    out = {}
    for fname, tensor_names in by_file.items():
        with safe_open(str(model_dir / fname), framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in tensor_names})
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 then cast back, times the weight (as Qwen3 does)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotate-half RoPE over the full head_dim. x: [T, heads, d]; positions: [T] absolute."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [d/2]
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    emb = torch.cat([angles, angles], dim=-1)  # [T, d]
    cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)  # [T, 1, d]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass(frozen=True)
class DraftGeometry:
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_config(cls, cfg: dict) -> DraftGeometry:
        dflash = cfg.get("dflash_config", {})
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise NotImplementedError(f"oracle drafter supports default RoPE only, config has {scaling}")
        return cls(
            block_size=int(cfg.get("block_size", dflash.get("block_size", 16))),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(x) for x in dflash["target_layer_ids"]],
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg["head_dim"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        )


class OracleDFlash:
    """The DFlash drafter of dflash.md §3, dense and for one request. Weights stay as plain tensors."""

    def __init__(self, draft_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32):
        self.draft_dir, self.target_dir, self.dtype = Path(draft_dir), Path(target_dir), dtype
        self.geom = DraftGeometry.from_config(json.loads((self.draft_dir / "config.json").read_text()))
        target_cfg = json.loads((self.target_dir / "config.json").read_text())
        self.w = {k: v.to(dtype) for k, v in read_safetensors(self.draft_dir).items()}
        # The drafter owns no embedding and no head: both are the target's (tied on Qwen3-4B).
        tied = bool(target_cfg.get("tie_word_embeddings", False))
        names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
        tw = read_safetensors(self.target_dir, names)
        self.embed = tw["model.embed_tokens.weight"].to(dtype)  # [V, H]
        self.lm_head = self.embed if tied else tw["lm_head.weight"].to(dtype)  # [V, H]

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[name].T  # weights are stored [out, in]

    def context_projection(self, context_features: torch.Tensor) -> torch.Tensor:
        """§3.2: hidden_norm(fc(feat)). [n, F*H] -> [n, H]."""
        return _rms_norm(
            self._linear("fc.weight", context_features.to(self.dtype)),
            self.w["hidden_norm.weight"],
            self.geom.rms_norm_eps,
        )

    def hidden(
        self,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
    ) -> torch.Tensor:
        """The draft stack on explicit positions: context rows [n, F*H] at context_positions [n], block
        tokens [B] at block_positions [B] -> final-normed block hidden states z [B, H]."""
        g = self.geom
        nh, nkv, d, eps = g.num_heads, g.num_kv_heads, g.head_dim, g.rms_norm_eps
        ctx = self.context_projection(context_features)  # [n, H]
        n, b = ctx.shape[0], block_ids.shape[0]
        x = self.embed[block_ids]  # [B, H]
        for i in range(g.num_layers):
            p = f"layers.{i}."
            # §3.3 KV injection: the context skips input_layernorm; k_norm then RoPE at its own positions.
            k_ctx = _rms_norm(
                self._linear(p + "self_attn.k_proj.weight", ctx).view(n, nkv, d),
                self.w[p + "self_attn.k_norm.weight"],
                eps,
            )
            k_ctx = _rope(k_ctx, context_positions, g.rope_theta)  # [n, nkv, d]
            v_ctx = self._linear(p + "self_attn.v_proj.weight", ctx).view(n, nkv, d)  # no norm, no RoPE
            # §3.4 the block: q_norm / k_norm per head before RoPE at the block's absolute positions.
            u = _rms_norm(x, self.w[p + "input_layernorm.weight"], eps)
            q = _rms_norm(
                self._linear(p + "self_attn.q_proj.weight", u).view(b, nh, d),
                self.w[p + "self_attn.q_norm.weight"],
                eps,
            )
            q = _rope(q, block_positions, g.rope_theta)  # [B, nh, d]
            k_blk = _rms_norm(
                self._linear(p + "self_attn.k_proj.weight", u).view(b, nkv, d),
                self.w[p + "self_attn.k_norm.weight"],
                eps,
            )
            k_blk = _rope(k_blk, block_positions, g.rope_theta)  # [B, nkv, d]
            v_blk = self._linear(p + "self_attn.v_proj.weight", u).view(b, nkv, d)
            keys = torch.cat([k_ctx, k_blk], dim=0)  # [n+B, nkv, d]
            values = torch.cat([v_ctx, v_blk], dim=0)  # [n+B, nkv, d]
            # GQA: q head h reads kv head h // (nh / nkv). No mask at all: every block row sees everything.
            group = nh // nkv
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(d)  # [nh, B, n+B]
            probs = torch.softmax(scores.float(), dim=-1).to(self.dtype)
            attn = torch.einsum("hqk,khd->qhd", probs, values).reshape(b, nh * d)  # [B, nh*d]
            x = x + self._linear(p + "self_attn.o_proj.weight", attn)
            w = _rms_norm(x, self.w[p + "post_attention_layernorm.weight"], eps)
            mlp = F.silu(self._linear(p + "mlp.gate_proj.weight", w)) * self._linear(p + "mlp.up_proj.weight", w)
            x = x + self._linear(p + "mlp.down_proj.weight", mlp)
        return _rms_norm(x, self.w["norm.weight"], eps)  # [B, H]

    def draft_logits(self, context_features: torch.Tensor, current_token: int, start: int) -> torch.Tensor:
        """§3.5: logits [B-1, V] for positions start+1..start+B-1 (same-position prediction, no shift).
        context_features [n, F*H] are the target taps of positions 0..start-1, so n must equal start."""
        n = context_features.shape[0]
        if n != start:
            raise ValueError(
                f"context has {n} rows but the current token is at position {start}: "
                f"drafter context rows must equal the committed length"
            )
        bsz = self.geom.block_size
        block = torch.full((bsz,), self.geom.mask_token_id, dtype=torch.long)
        block[0] = current_token  # [current, MASK x (B-1)]
        z = self.hidden(context_features, torch.arange(n), block, torch.arange(start, start + bsz))
        return z[1:] @ self.lm_head.T  # [B-1, V]; row 0 (the known current token) is dropped

    def draft(self, context_features: torch.Tensor, current_token: int, start: int) -> list[int]:
        """The B-1 greedy draft tokens for positions start+1..start+B-1."""
        return self.draft_logits(context_features, current_token, start).argmax(-1).tolist()


@functools.lru_cache(maxsize=4)
def _oracle(draft_dir: str, target_dir: str, dtype: torch.dtype) -> OracleDFlash:
    return OracleDFlash(draft_dir, target_dir, dtype)


@dataclass(frozen=True)
class OracleSpecRun:
    output_ids: list[int]  # generated tokens (EOS kept when it stopped there)
    accepted_lengths: list[int]  # tau per verify step = a + 1 (before EOS truncation of that step)
    drafts: list[list[int]]  # the drafts verified at each step (already truncated to the span)
    committed_lengths: list[int]  # tokens each step committed: a + 1, cut right after an EOS
    draft_margins: list[list[float]]  # per step, drafter top-1 minus top-2 logit at each draft; [] per step
    # when the drafter gives no logits (a scripted test drafter)


def oracle_spec_generate(
    target_dir: str | Path,
    draft_dir: str | Path,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    dtype: torch.dtype = torch.float32,
    drafter: OracleDFlash | None = None,
) -> OracleSpecRun:
    """The reference loop of dflash.md §4.1, with the HF target recomputed densely at every step.

    The drafter always drafts a full block; a step with `remaining` budget verifies a span of
    S = min(B, remaining) tokens [current, d_1..d_{S-1}], so it commits at most S new tokens and never
    runs past max_new_tokens. EOS anywhere in a committed run truncates the output right after it.
    `drafter` replaces the checkpoint drafter (anything with .geom and .draft(context, token, start)):
    tests use it to force long acceptance runs, which a random drafter never produces.
    """
    if max_new_tokens <= 0 or not prompt_ids:
        raise ValueError(f"need a non-empty prompt and max_new_tokens > 0 (got {len(prompt_ids)}, {max_new_tokens})")
    oracle = drafter or _oracle(str(Path(draft_dir).resolve()), str(Path(target_dir).resolve()), dtype)
    eos = hf_reference._eos_set(eos_token_id)
    taps, bsz = oracle.geom.target_layer_ids, oracle.geom.block_size
    prompt = list(prompt_ids)
    # prefill: features of every prompt position; its last row's argmax is the first current token
    logits, feats = hf_reference.target_forward(target_dir, prompt, taps, dtype)  # [N, V], [N, F*H]
    out, taus, drafts_log, committed_log, margins_log = [int(logits[-1].argmax())], [], [], [], []
    context = feats  # [start, F*H]: taps of every committed position except the current token
    while out[-1] not in eos and len(out) < max_new_tokens:
        start = len(prompt) + len(out) - 1  # absolute position of the current token
        span = min(bsz, max_new_tokens - len(out))
        if isinstance(oracle, OracleDFlash):
            draft_logits = oracle.draft_logits(context, out[-1], start)[: span - 1]  # [S-1, V]
            drafts = draft_logits.argmax(-1).tolist()
            top2 = draft_logits.float().topk(2, dim=-1).values  # [S-1, 2]
            margins_log.append((top2[:, 0] - top2[:, 1]).tolist())
        else:
            drafts = oracle.draft(context, out[-1], start)[: span - 1]
            margins_log.append([])
        ids = prompt + out + drafts  # verify [current, d_1..d_{S-1}] on top of the committed prefix
        logits, feats = hf_reference.target_forward(target_dir, ids, taps, dtype)
        post = logits[start : start + span].argmax(-1).tolist()  # [S]: post[j] predicts position start+j+1
        a = 0
        while a < len(drafts) and drafts[a] == post[a]:
            a += 1
        committed = drafts[:a] + [post[a]]  # a accepted drafts + the bonus
        taus.append(a + 1)
        drafts_log.append(drafts)
        before = len(out)
        for tok in committed:
            out.append(tok)
            if tok in eos:
                break
        committed_log.append(len(out) - before)
        context = feats[: start + a + 1]  # + rows of [current, d_1..d_a]; the bonus has no taps yet
    return OracleSpecRun(
        output_ids=out,
        accepted_lengths=taus,
        drafts=drafts_log,
        committed_lengths=committed_log,
        draft_margins=margins_log,
    )
