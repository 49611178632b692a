"""Size the KV pool on a real GPU: read device memory with the target resident, profile a worst-case step's
activation peak with a temporary KV, reserve the drafter's footprint, and ask the planner for blocks."""
from __future__ import annotations

import torch

from refengine.attention import make_backend
from refengine.attention.base import AttnBatch
from refengine.config import DFlashConfig
from refengine.kv.pool import KvPool, blocks_for
from refengine.memory import DFlashMemoryReservation
from refengine.memory_plan import KvBudgetPlan, plan_kv_budget, profile_activation_peak, read_device_memory
from refengine.request import MAX_LOGPROBS as TOPK_MAX
from refengine.runner.model_runner import LOGIT_CHUNK_ROWS, read_logits


def worst_case_rows(engine) -> int:
    """Most rows one target forward can carry: a prefill chunk of max_prefill_tokens, a single long prompt
    (admitted alone even past max_prefill_tokens), or every running request's verify span."""
    c = engine.config
    span = 16 if engine.speculating else 1
    return max(c.max_prefill_tokens, engine.max_context, c.max_num_seqs * span)


def profile_step(engine, capture: tuple[int, ...], rows: int) -> int:
    """Activation peak (bytes) of one target forward of `rows` rows, over a temporary KV pool allocated
    before the measurement starts (so the KV is not counted).
    The attention backend (FlashInfer's workspace) is built inside the measured step: the engine allocates
    its own after planning, so it belongs to what the plan must leave room for."""
    cfg, t = engine.target.cfg, engine.target
    page = engine.config.page_size
    # as many requests as it takes: no row may sit past the context (RoPE tables end there)
    lens = [min(engine.max_context, rows - lo) for lo in range(0, rows, engine.max_context)]
    pool = KvPool(cfg.num_layers, sum(blocks_for(n, page) for n in lens), page, cfg.num_kv_heads, cfg.head_dim,
                  t.dtype, t.device)
    for i, n in enumerate(lens):
        pool.admit(i, n)
        pool.extend(i, n)
    ids = torch.zeros(rows, dtype=torch.long, device=t.device)
    batch = AttnBatch(q_lens=lens, kv_lens=lens, block_tables=[pool.allocator.table(i) for i in range(len(lens))],
                      slots=torch.cat([pool.slots(i, 0, n) for i, n in enumerate(lens)]).to(t.device),
                      positions=torch.cat([torch.arange(n) for n in lens]).to(t.device))

    def step():
        attention = make_backend(engine.config.backend_name, pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        with torch.inference_mode():
            hidden, _feats = t.forward(ids, batch, pool, attention, capture)
            # the worst read-out: one full chunk of logits with fp32 log-softmax and top-k (prompt logprobs)
            read_logits(t, hidden[-min(rows, LOGIT_CHUNK_ROWS):], TOPK_MAX)

    # The temporary pool exists before the baseline is read, so the measured rise holds no KV to subtract.
    peak = profile_activation_peak(step, str(t.device), temporary_kv_bytes=0)
    del pool, batch
    torch.cuda.empty_cache()
    return peak.non_kv_peak_increase_bytes


def plan_pool(engine, draft_cfg: DFlashConfig | None) -> KvBudgetPlan:
    c, dev = engine.config, str(engine.target.device)
    dtype_bytes = engine.target.dtype.itemsize
    reservation = None
    if draft_cfg is not None:
        reservation = DFlashMemoryReservation.from_models(
            engine.target.cfg, draft_cfg, page_size=c.page_size, max_decode_batch=c.max_num_seqs,
            dtype_bytes=dtype_bytes, accounting=c.memory_accounting)
    torch.cuda.empty_cache()
    device = read_device_memory(dev)  # target resident, drafter not yet loaded, nothing cached
    # what the device holds outside torch's allocator (CUDA context, other processes): lets a caller turn
    # torch.cuda.max_memory_reserved() into a device-level peak to hold against the plan
    engine.kv_plan_outside_torch_bytes = device.used_bytes - torch.cuda.memory_reserved(dev)
    capture = draft_cfg.target_layer_ids if draft_cfg is not None else ()
    activation = profile_step(engine, capture, worst_case_rows(engine))
    plan = plan_kv_budget(device, target_config=engine.target.cfg, gpu_memory_utilization=c.gpu_memory_utilization,
                          reservation=reservation, activation_peak_bytes=activation, page_size=c.page_size,
                          dtype_bytes=dtype_bytes, max_context_tokens=engine.max_context)
    # Enforce the plan on torch's caching allocator: past the cap it frees cached blocks before it grows, so
    # fragmentation cannot carry the process past the utilisation it was given (a real shortfall still OOMs).
    cap = (plan.requested_bytes - engine.kv_plan_outside_torch_bytes) / device.total_bytes
    torch.cuda.set_per_process_memory_fraction(min(max(cap, 0.0), 1.0), engine.target.device)
    return plan
