"""Which target weights split how at tensor-parallel size tp (Megatron layout):

    q_proj, k_proj, v_proj   column-parallel by heads: rank r holds num_heads/tp query heads and its KV heads
    o_proj                   row-parallel (its input columns split by query head); partial sums all-reduced
    gate_proj, up_proj       column-parallel (intermediate rows split)
    down_proj                row-parallel (intermediate columns split); partial sums all-reduced
    norms, q/k norms, RoPE   replicated
    embed_tokens, lm_head    replicated (see below)

KV heads: when tp divides num_kv_heads each rank holds num_kv_heads/tp of them; when num_kv_heads divides tp
(fewer KV heads than ranks, e.g. the tiny pairs' single KV head at tp 2) each rank holds one KV head, the one
its query heads read (vLLM's replication rule), so the pool per rank is num_kv_heads/tp heads, at least one.

Embedding and lm_head are replicated, not vocab-parallel: Qwen3 ties them (one tensor), every rank needs the
full input rows, and only rank 0 reads logits (argmax, top-k, and the drafter's head, which shares the target's
lm_head); a vocab-parallel head would need an all-gather of logits or a distributed top-k in read_logits for no
gain at this scale. After each all-reduce the hidden states are full and identical on every rank, so the
tap-layer features rank 0 hands the drafter are the full hidden states, as at tp 1.
"""

from __future__ import annotations

import dataclasses

import torch

from refengine.config import ModelConfig
from refengine.errors import UnsupportedConfigError
from refengine.models.layers import DecoderLayerWeights


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """UnsupportedConfigError naming the head counts unless `cfg` can be split over tp ranks."""
    if tp == 1:
        return
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by {tp}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} neither divides nor is divisible by {tp}")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by {tp}")
    if problems:
        raise UnsupportedConfigError(f"tensor_parallel_size={tp} does not fit the target: " + "; ".join(problems))


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The per-rank geometry: what one rank's shard (and its KV pool) looks like."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=max(cfg.num_kv_heads // tp, 1),
        intermediate_size=cfg.intermediate_size // tp,
    )


def kv_head_range(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """The global KV heads [first, last) rank `rank` holds."""
    if cfg.num_kv_heads >= tp:
        n = cfg.num_kv_heads // tp
        return rank * n, (rank + 1) * n
    head = rank // (tp // cfg.num_kv_heads)  # the KV head this rank's query heads read (GQA group)
    return head, head + 1


def _rows(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return w[lo:hi].clone()  # a copy, so the full checkpoint tensor can be freed


def _cols(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return w[:, lo:hi].clone(memory_format=torch.contiguous_format)  # one copy, owning its storage


def shard_layer(w: DecoderLayerWeights, cfg: ModelConfig, rank: int, tp: int) -> DecoderLayerWeights:
    d = cfg.head_dim
    nq = cfg.num_heads // tp
    k0, k1 = kv_head_range(cfg, rank, tp)
    inter = cfg.intermediate_size // tp
    return DecoderLayerWeights(
        input_norm=w.input_norm,
        post_norm=w.post_norm,
        q_proj=_rows(w.q_proj, rank * nq * d, (rank + 1) * nq * d),
        k_proj=_rows(w.k_proj, k0 * d, k1 * d),
        v_proj=_rows(w.v_proj, k0 * d, k1 * d),
        o_proj=_cols(w.o_proj, rank * nq * d, (rank + 1) * nq * d),
        q_norm=w.q_norm,
        k_norm=w.k_norm,
        gate_proj=_rows(w.gate_proj, rank * inter, (rank + 1) * inter),
        up_proj=_rows(w.up_proj, rank * inter, (rank + 1) * inter),
        down_proj=_cols(w.down_proj, rank * inter, (rank + 1) * inter),
    )


def shard_target(model, rank: int, tp: int):
    """A Qwen3Model holding rank `rank`'s shard of `model` (loaded whole: fine for a reference engine; a
    production loader would read only its slices). Its cfg is the per-rank geometry (local_config); the caller
    attaches the all-reduce (Qwen3Model.all_reduce)."""
    from refengine.models.qwen3 import Qwen3Model

    check_tensor_parallel(model.cfg, tp)
    layers = [shard_layer(w, model.cfg, rank, tp) for w in model.layers]
    out = Qwen3Model(local_config(model.cfg, tp), model.embed_tokens, layers, model.final_norm, model.lm_head)
    out.tp_size = tp
    return out
