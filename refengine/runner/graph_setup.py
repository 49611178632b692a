"""Build the graph runners of an engine: decode and verify for the target, the block forward for the drafter.
Merged weights and fused kernels are set up here (FlashInfer's on CUDA in bf16/fp16, torch's otherwise)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from refengine.attention.graph_attention import FlashInferGraphAttention, TorchGraphAttention
from refengine.config import EngineConfig, ModelConfig
from refengine.kv.pool import KvPool
from refengine.models.dflash import DFlashDrafter
from refengine.models.kernels import kernels_for
from refengine.models.qwen3 import Qwen3Model
from refengine.models.segmented import SegmentedStack, merge_layer
from refengine.runner.capture import Capturer
from refengine.runner.graphs import GraphRunner
from refengine.runner.shapes import row_caps


def _attention_factory(
    config: EngineConfig, pool: KvPool, cfg: ModelConfig, workspace_bytes: int
) -> Callable[[int], object]:
    if config.backend_name == "flashinfer":
        return lambda bucket: FlashInferGraphAttention(
            pool, bucket, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, workspace_bytes
        )
    return lambda bucket: TorchGraphAttention(pool)


def _kernels(config: EngineConfig, model_dtype: torch.dtype, device: torch.device):
    half = model_dtype in (torch.bfloat16, torch.float16)  # FlashInfer's norm / rope / activation kernels
    return kernels_for(device, frozenset(config.fused_ops_names) if half else frozenset())


def build_target_graphs(
    target: Qwen3Model,
    pool: KvPool,
    config: EngineConfig,
    capturer: Capturer,
    tap_layers: tuple[int, ...],
    verify_span: int | None,
    feature_store: torch.Tensor | None = None,
    capture_shape_rule: bool = True,
    workspace_bytes: int = 0,
) -> dict[str, GraphRunner]:
    """'decode' (one row per request) and, with a proposer, 'verify' (up to verify_span rows per request, in
    shapes of 2, 4, ..., verify_span rows per request: see graphs.row_caps). Every step of either writes its
    rows' tap features into `feature_store` [slots, F*H] at their slots (spec_decode/feature_store.py).
    `workspace_bytes`: FlashInfer's shared float workspace (attention/workspace.py graph_float_workspace_bytes).
    """
    stack = SegmentedStack(
        target.cfg,
        [merge_layer(w) for w in target.layers],
        target.embed_tokens,
        target.final_norm,
        target.lm_head,
        target.rope,
        pool,
        _kernels(config, target.dtype, target.device),
        tap_layers,
        feature_store=feature_store,
    )
    make = _attention_factory(config, pool, target.cfg, workspace_bytes)
    kw = dict(
        mode=config.graph_mode_name,
        max_batch=config.max_num_seqs,
        causal=True,
        score="all",
        capturer=capturer,
        capture_shape_rule=capture_shape_rule,
    )
    runners = {"decode": GraphRunner(stack, make, span=1, **kw)}  # type: ignore[arg-type]
    if verify_span is not None:
        runners["verify"] = GraphRunner(stack, make, span=verify_span, caps=row_caps(verify_span), **kw)  # type: ignore[arg-type]
    return runners


def build_draft_graph(
    drafter: DFlashDrafter,
    pool: KvPool,
    config: EngineConfig,
    capturer: Capturer,
    feature_store: torch.Tensor | None = None,
    workspace_bytes: int = 0,
) -> GraphRunner:
    """The drafter's block forward; its context rows are gathered from `feature_store` inside the graph. Its
    score caps (draft_score_caps, graphs.py): a step whose spans are all <= 4 scores 3 rows a block, not 15.
    `workspace_bytes` as for build_target_graphs."""
    m = drafter.mcfg
    stack = SegmentedStack(
        m,
        [merge_layer(w) for w in drafter.layers],
        drafter.embed_tokens,
        drafter.norm,
        drafter.lm_head,
        drafter.rope,
        pool,
        _kernels(config, drafter.fc.dtype, drafter.fc.device),
        context_proj=(drafter.fc, drafter.hidden_norm),
        feature_store=feature_store,
    )
    return GraphRunner(
        stack,
        _attention_factory(config, pool, m, workspace_bytes),
        mode=config.graph_mode_name,
        span=drafter.cfg.block_size,
        max_batch=config.max_num_seqs,
        causal=False,
        score="block",
        capturer=capturer,
        caps=draft_score_caps(drafter.cfg.block_size),
    )


def draft_score_caps(block: int) -> tuple[int, ...]:
    """The drafter's score caps: the verify's row caps from 4. H200, Qwen3-4B's vocab, c32: the LM head and
    argmax over 15 / 7 / 3 rows a block 0.595 / 0.343 / 0.241 ms; at c1 0.198-0.204 whatever the rows, so a
    1-row shape would save little more than the 3-row one and cost a graph a bucket."""
    return tuple(c for c in row_caps(block) if c >= min(4, block))
