"""How an Engine's parts are sized and built from its config, beside the engine's own step logic: a shared
target's check, the KV pool's default size, the CUDA graph runners (target decode / verify, the drafter's
block and catch-up graphs)."""

from __future__ import annotations

import torch

from refengine.attention.workspace import device_sm_count, graph_float_workspace_bytes
from refengine.config import DFlashConfig, EngineConfig, ModelConfig, read_config_json
from refengine.errors import UnsupportedConfigError
from refengine.kv.pool import KvPool, blocks_for
from refengine.memory.planner import KvBudgetPlan
from refengine.memory.reservation import target_kv_bytes_per_block
from refengine.models.qwen3 import Qwen3Model
from refengine.runner.capture import Capturer
from refengine.runner.catch_up_graphs import CatchUpGraphs
from refengine.runner.draft_graphs import DraftGraphs
from refengine.runner.graph_setup import build_draft_graph, build_target_graphs
from refengine.runner.graphs import GraphRunner
from refengine.spec_decode.feature_store import FeatureStore
from refengine.spec_decode.lane import DFlashLane
from refengine.spec_decode.proposer import Proposer

CPU_KV_BYTES = 256 * 1024 * 1024  # default KV pool on the CPU


def check_shared_target(target: Qwen3Model, config: EngineConfig, dtype: torch.dtype) -> None:
    """A target handed to Engine must be what config would load: same geometry, device and dtype, unsharded."""
    want = ModelConfig.from_hf(read_config_json(config.target_path))
    got_device, got_dtype = target.embed_tokens.device, target.embed_tokens.dtype
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None:  # "cuda" names the current device: cuda:0 by default
        device = torch.device("cuda", torch.cuda.current_device())
    if config.tensor_parallel_size > 1 or target.tp_size > 1:
        raise UnsupportedConfigError("a shared target cannot be tensor-parallel (each engine shards its own)")
    if target.cfg != want or got_dtype != dtype or got_device != device:
        raise UnsupportedConfigError(
            f"the shared target ({got_device}, {got_dtype}, {target.cfg}) is not the model config loads "
            f"({config.device}, {dtype}, {want})"
        )


def default_num_blocks(
    target: Qwen3Model, config: EngineConfig, dtype: torch.dtype, draft_cfg: DFlashConfig | None, max_context: int
) -> tuple[int, KvBudgetPlan | None]:
    """The KV pool's blocks and, on CUDA, the plan they come from: planned from device memory (before the
    drafter loads: the reservation bills it), else enough for max_num_seqs full-length requests within
    CPU_KV_BYTES."""
    if target.device.type == "cuda":
        from refengine.memory.profile import cap_torch_allocator, plan_device_pool

        plan = plan_device_pool(target, config, draft_cfg, max_context)
        cap_torch_allocator(plan, target.device)
        return plan.num_blocks, plan
    bytes_per_block = target_kv_bytes_per_block(target.cfg, config.page_size, dtype.itemsize)
    wanted = config.max_num_seqs * blocks_for(max_context, config.page_size)
    return max(1, min(wanted, CPU_KV_BYTES // bytes_per_block)), None


def build_graphs(
    config: EngineConfig, target: Qwen3Model, pool: KvPool, proposer: Proposer | None, store: FeatureStore | None
) -> tuple[dict[str, GraphRunner], DraftGraphs | None]:
    """The decode / verify graph runners and, for the DFlash lane, its draft and catch-up graphs (made the
    lane's executor), unless graph_mode is 'eager'."""
    if config.graph_mode_name == "eager":
        return {}, None
    capturer = Capturer(target.device)
    taps = proposer.capture_layers if proposer is not None else ()
    span = proposer.block_size if proposer is not None else None
    rows = store.rows if store is not None else None
    lane = proposer if isinstance(proposer, DFlashLane) and store is not None else None
    workspace = 0  # FlashInfer's float workspace, shared by every graph wrapper (the planner bills the same)
    if config.backend_name == "flashinfer":
        models = [target.cfg] + ([lane.drafter.mcfg] if lane is not None else [])
        workspace = graph_float_workspace_bytes(config.max_num_seqs, span or 1, models, device_sm_count(target.device))
    draft = None
    if lane is not None and store is not None:
        graph = build_draft_graph(lane.drafter, lane.pool, config, capturer, rows, workspace)
        catch_up = CatchUpGraphs(graph.stack, capturer, store.pool.dummy_slot)
        draft = DraftGraphs(graph, catch_up, lane.pool.dummy_slot, store.pool.dummy_slot)
        lane.executor = draft
    return build_target_graphs(target, pool, config, capturer, taps, span, rows, workspace_bytes=workspace), draft
