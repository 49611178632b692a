"""Size the KV pool on a real GPU: read device memory with the target resident, profile a worst-case step's
activation peak over a temporary KV, reserve the drafter's footprint, and ask the planner for blocks.

`plan_device_pool` depends only on its arguments (the loaded target, the user's config, the drafter's
config and the context cap); the engine applies the returned plan (pool size, allocator cap)."""

from __future__ import annotations

import torch

from refengine.attention import make_backend
from refengine.attention.base import AttnBatch
from refengine.attention.workspace import (
    device_sm_count,
    flashinfer_float_workspace_bytes,
    graph_float_workspace_bytes,
)
from refengine.config import DFlashConfig, EngineConfig
from refengine.kv.pool import KvPool, blocks_for
from refengine.memory.device import profile_activation_peak, read_device_memory
from refengine.memory.planner import KvBudgetPlan, plan_kv_budget
from refengine.memory.reservation import DFlashMemoryReservation
from refengine.models.qwen3 import Qwen3Model
from refengine.request import MAX_LOGPROBS
from refengine.runner.logits import LOGIT_CHUNK_ROWS, read_logits


def worst_case_rows(config: EngineConfig, draft_cfg: DFlashConfig | None, max_context: int) -> int:
    """Most rows one target forward can carry: a prefill chunk of max_prefill_tokens, a single long prompt
    (admitted alone even past max_prefill_tokens), or every running request's verify span."""
    span = draft_cfg.block_size if draft_cfg is not None else 1
    return max(config.max_prefill_tokens, max_context, config.max_num_seqs * span)


def profile_step(
    target: Qwen3Model, config: EngineConfig, capture: tuple[int, ...], rows: int, max_context: int
) -> int:
    """Activation peak (bytes) of one target forward of `rows` rows, over a temporary KV pool allocated
    before the measurement starts (so the KV is not counted).
    The attention backend (FlashInfer's workspace) is built inside the measured step: the engine allocates
    its own after planning, so it belongs to what the plan must leave room for."""
    peak = _profile_forward(target, config, capture, rows, max_context)  # its temporaries are gone on return
    torch.cuda.empty_cache()
    return peak


def _profile_forward(
    target: Qwen3Model, config: EngineConfig, capture: tuple[int, ...], rows: int, max_context: int
) -> int:
    cfg, page = target.cfg, config.page_size
    # as many requests as it takes: no row may sit past the context (RoPE tables end there)
    lens = [min(max_context, rows - lo) for lo in range(0, rows, max_context)]
    pool = KvPool(
        cfg.num_layers,
        sum(blocks_for(n, page) for n in lens),
        page,
        cfg.num_kv_heads,
        cfg.head_dim,
        target.dtype,
        target.device,
    )
    for i, n in enumerate(lens):
        pool.admit(i, n)
        pool.extend(i, n)
    ids = torch.zeros(rows, dtype=torch.long, device=target.device)
    batch = AttnBatch(
        q_lens=lens,
        kv_lens=lens,
        block_tables=[pool.table(i) for i in range(len(lens))],
        slots=torch.cat([pool.slots(i, 0, n) for i, n in enumerate(lens)]).to(target.device),
        positions=torch.cat([torch.arange(n) for n in lens]).to(target.device),
    )

    def step() -> None:
        attention = make_backend(config.backend_name, pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        with torch.inference_mode():
            hidden, _feats = target.forward(ids, batch, pool, attention, capture)
            # the worst read-out: one full chunk of logits with fp32 log-softmax and top-k (prompt logprobs)
            read_logits(target, hidden[-min(rows, LOGIT_CHUNK_ROWS) :], MAX_LOGPROBS)

    # The temporary pool exists before the baseline is read, so the measured rise holds no KV to subtract.
    return profile_activation_peak(step, str(target.device), temporary_kv_bytes=0).non_kv_peak_increase_bytes


FLASHINFER_INT_WORKSPACE_BYTES = 8 << 20  # each graph-mode wrapper's own device int workspace


def graph_pool_bytes(target: Qwen3Model, config: EngineConfig, draft_cfg: DFlashConfig | None, max_context: int) -> int:
    """What the CUDA graphs keep for the engine's life: the private pool holding the temporaries of the
    largest captured step (profiled as an eager forward of that many rows: the [rows, vocab] logits
    dominate), every bucket's persistent buffers, one FlashInfer int workspace per graph-mode wrapper and the
    float workspace they share (sized for the largest bucket's verify and draft plans, as build_graphs does).
    The drafter graph's temporaries are the lane's batch scratch, and its catch-up graphs' (buffers and
    temporaries of at most 1024 rows) its context flush scratch: both already in the DFlash reservation."""
    from refengine.runner.shapes import batch_buckets, row_caps

    c, b = target.cfg, target.dtype.itemsize
    span = draft_cfg.block_size if draft_cfg is not None else 1
    taps = len(draft_cfg.target_layer_ids) if draft_cfg is not None else 0
    buckets = batch_buckets(config.max_num_seqs)
    per_row = b * (2 * c.hidden_size + 2 * c.q_dim + c.kv_dim + taps * c.hidden_size) + 4 * 8
    verify_rows = sum(row_caps(span)) if draft_cfg is not None else 0  # per request, over the verify shapes
    rows = sum(buckets) * (1 + verify_rows)  # decode + verify shapes
    wrappers = len(buckets) * (1 + 2 * (draft_cfg is not None))  # decode, verify (shared by caps), draft
    static = rows * per_row
    if config.backend_name == "flashinfer":
        models = [c] + ([draft_cfg.model] if draft_cfg is not None else [])
        workspace = graph_float_workspace_bytes(config.max_num_seqs, span, models, device_sm_count(target.device))
        static += wrappers * FLASHINFER_INT_WORKSPACE_BYTES + workspace
    if draft_cfg is not None:
        d = draft_cfg.model
        static += sum(buckets) * span * (b * (2 * d.hidden_size + 2 * d.q_dim + d.kv_dim) + 4 * 8)
    capture = draft_cfg.target_layer_ids if draft_cfg is not None else ()
    return static + profile_step(target, config, capture, config.max_num_seqs * span, max_context)


def lane_workspace_bytes(target: Qwen3Model, config: EngineConfig, draft_cfg: DFlashConfig | None) -> int:
    """The drafter lane's eager FlashInfer wrapper's float workspace, held for the engine's life in every graph
    mode (the target's eager one is built inside the profiled step, so the activation peak holds it)."""
    if draft_cfg is None or config.backend_name != "flashinfer":
        return 0
    m = draft_cfg.model
    return flashinfer_float_workspace_bytes(m.num_heads, m.num_kv_heads, m.head_dim, device_sm_count(target.device))


def plan_device_pool(
    target: Qwen3Model, config: EngineConfig, draft_cfg: DFlashConfig | None, max_context: int
) -> KvBudgetPlan:
    """The KV plan for this device. Call it with the target resident and the drafter not yet loaded: the
    reservation bills the drafter's weights itself, so reading memory after loading it would count them twice.
    `draft_cfg` is None when speculation is off."""
    dev, dtype_bytes = str(target.device), target.dtype.itemsize
    reservation = None
    if draft_cfg is not None:
        reservation = DFlashMemoryReservation.from_models(
            target.cfg,
            draft_cfg,
            page_size=config.page_size,
            max_decode_batch=config.max_num_seqs,
            dtype_bytes=dtype_bytes,
            accounting=config.memory_accounting,
        )
    torch.cuda.empty_cache()
    device = read_device_memory(dev)  # target resident, drafter not yet loaded, nothing cached
    capture = draft_cfg.target_layer_ids if draft_cfg is not None else ()
    activation = profile_step(target, config, capture, worst_case_rows(config, draft_cfg, max_context), max_context)
    graphs = 0 if config.graph_mode_name == "eager" else graph_pool_bytes(target, config, draft_cfg, max_context)
    return plan_kv_budget(
        device,
        target_config=target.cfg,
        gpu_memory_utilization=config.gpu_memory_utilization,
        reservation=reservation,
        activation_peak_bytes=activation + graphs + lane_workspace_bytes(target, config, draft_cfg),
        graph_pool_bytes=graphs,
        page_size=config.page_size,
        dtype_bytes=dtype_bytes,
        max_context_tokens=max_context,
        # what the device holds outside torch's allocator (CUDA context, other processes)
        outside_torch_bytes=device.used_bytes - torch.cuda.memory_reserved(dev),
    )


def cap_torch_allocator(plan: KvBudgetPlan, device: torch.device) -> None:
    """Enforce the plan on torch's caching allocator: past the cap it frees cached blocks before it grows, so
    fragmentation cannot carry the process past the utilisation it was given (a real shortfall still OOMs)."""
    torch.cuda.set_per_process_memory_fraction(plan.allocator_cap_fraction, device)
