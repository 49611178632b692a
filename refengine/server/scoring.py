"""Prompt logprobs for `echo` + `logprobs` (what lm-eval's loglikelihood asks for).

OpenAI's format needs the logprob of every prompt token, which may lie outside the top-k the engine returns
(Engine.score gives top-k rows only). This runs one dense causal forward of the target with the engine's own
weights and layer functions (refengine/models/layers.py: project_qkv, mlp_residual; the final norm and lm_head
of Qwen3Model) and SDPA, without touching the KV pool, then reads the exact logprob of each prompt token and
the top-k of its position in fp32. Prompt scoring involves no speculation, so it is the same with the drafter
on or off. Runs on the engine loop thread."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refengine.errors import UnsupportedConfigError
from refengine.models.layers import mlp_residual, project_qkv, rms_norm
from refengine.models.qwen3 import Qwen3Model

Row = tuple[float, list[int], list[float]]  # (logprob of the actual token, top-k ids, top-k logprobs)


@torch.inference_mode()
def prompt_logprobs(target: Qwen3Model, token_ids: list[int], k: int) -> list[Row | None]:
    """One entry per token: None for the first (nothing predicts it), else the logprob of token_ids[i] after
    token_ids[:i] and the top-k at that position (k >= 1)."""
    if target.tp_size > 1:  # its dense forward would run rank 0's shard alone, with no all-reduce
        raise UnsupportedConfigError(
            f"prompt logprobs (echo + logprobs) are tensor_parallel_size 1 only for now (this engine: {target.tp_size})"
        )
    cfg = target.cfg
    dev = target.device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
    pos = torch.arange(len(token_ids), device=dev)
    h = target.embed_tokens[ids]
    for w in target.layers:
        q, kk, v = project_qkv(w, rms_norm(h, w.input_norm, cfg.rms_norm_eps), cfg, target.rope, pos)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1)
        h = h + F.linear(attn.reshape(h.shape[0], -1), w.o_proj)
        h = mlp_residual(w, h, cfg.rms_norm_eps)
    hidden = rms_norm(h, target.final_norm, cfg.rms_norm_eps)[:-1]
    out: list[Row | None] = [None]
    for lo in range(0, hidden.shape[0], 1024):  # bounded [rows, vocab] transient
        lp = target.logits(hidden[lo : lo + 1024], fp32=True).log_softmax(-1)
        nxt = ids[lo + 1 : lo + 1 + lp.shape[0]]
        actual = lp.gather(1, nxt[:, None])[:, 0].tolist()
        top = lp.topk(max(k, 1), dim=-1)
        for a, ti, tv in zip(actual, top.indices.tolist(), top.values.tolist()):
            out.append((a, ti, tv))
    return out
