"""The KV planner on a real GPU at Qwen3-4B shapes (synthetic weights from the shape-only configs), DFlash on,
utilisation 0.90: the pool is filled with concurrent long requests up to its admission limit (one more waits)
and all run to the end with no out-of-memory error; the measured peak (allocated, and reserved by the
caching allocator, which the engine caps at the plan) stays under the planned budget; and the tight ("lane")
reservation never under-reserves what the drafter lane really allocates
(persistent context K/V and pending features, and the transient peak of a batched draft).

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_memory.py -s
"""

from __future__ import annotations

import pytest
import torch

from refengine import Engine, EngineConfig, SamplingParams
from refengine.kv.pool import blocks_for
from refengine.memory import DFlashMemoryReservation

pytestmark = pytest.mark.gpu
CONFIGS = "fixtures/configs"
LIFETIME = 12288
NEW_TOKENS = 24


@pytest.mark.parametrize("accounting", ["lane"])
def test_qwen3_4b_shapes_fill_pool_to_admission_limit(accounting):
    engine = Engine(
        EngineConfig(
            f"{CONFIGS}/qwen3-4b",
            draft_path=f"{CONFIGS}/qwen3-4b-dflash-b16",
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            synthetic_weights=True,
            gpu_memory_utilization=0.90,
            memory_accounting=accounting,
            max_model_len=LIFETIME,
            max_num_seqs=64,
        )
    )
    plan = engine.kv_plan
    res = DFlashMemoryReservation.from_models(
        engine.target.cfg, engine.drafter.cfg, page_size=16, max_decode_batch=64, accounting=accounting
    )
    fit = engine.pool.num_blocks // blocks_for(LIFETIME, 16)
    print(f"\nplan: {plan.summary()}\nfull-length requests that fit: {fit}")
    assert 1 <= fit < 64
    prompt = [7] * (LIFETIME - NEW_TOKENS)
    reqs = [engine.add_request(prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) for _ in range(fit + 1)]

    lane, propose = engine.proposer, engine.proposer.propose
    draft_peak = {"bytes": 0, "batch": 0}

    def measured_propose(items):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = propose(items)
        torch.cuda.synchronize()
        rise = torch.cuda.max_memory_allocated() - base
        if rise > draft_peak["bytes"]:
            draft_peak.update(bytes=rise, batch=len(items))
        return out

    lane.propose = measured_propose

    torch.cuda.reset_peak_memory_stats()
    max_running, max_lane_bytes = 0, 0
    device_peak = alloc_peak = 0
    while engine.has_work():
        engine.step()
        torch.cuda.synchronize()
        device_peak = max(device_peak, torch.cuda.max_memory_reserved())
        alloc_peak = max(alloc_peak, torch.cuda.max_memory_allocated())
        max_running = max(max_running, len(engine.scheduler.running))
        max_lane_bytes = max(max_lane_bytes, lane.persistent_bytes())
    engine.check_integrity()
    assert all(len(r.output_ids) == NEW_TOKENS for r in reqs)
    assert max_running == fit, f"admission let {max_running} run at once, the pool fits {fit}"

    measured = plan.outside_torch_bytes + device_peak
    lane_reserved_per_token = (
        res.per_token_bytes * res.pool_billed_tokens([LIFETIME] * fit)
        + res.block_headroom_bytes * fit // res.max_decode_batch
    )  # each request's B block-scratch rows
    lane_reserved_scratch = res.batch_dense_scratch_bytes + res.batch_logits_scratch_bytes
    print(
        f"planned budget {plan.requested_bytes / 2**30:.2f} GiB, measured device peak {measured / 2**30:.2f} GiB "
        f"(allocated peak {(plan.outside_torch_bytes + alloc_peak) / 2**30:.2f} GiB); "
        f"lane persistent {max_lane_bytes / 2**30:.3f} GiB <= reserved {lane_reserved_per_token / 2**30:.3f} GiB; "
        f"draft transient {draft_peak['bytes'] / 2**20:.1f} MiB at batch {draft_peak['batch']} <= reserved scratch "
        f"{lane_reserved_scratch / 2**20:.1f} MiB"
    )
    allocated = plan.outside_torch_bytes + alloc_peak
    assert allocated <= plan.requested_bytes, (
        f"allocated peak {allocated:,} B over the planned {plan.requested_bytes:,} B"
    )
    assert measured <= plan.requested_bytes, f"device peak {measured:,} B over the planned {plan.requested_bytes:,} B"
    assert max_lane_bytes <= lane_reserved_per_token
    assert draft_peak["bytes"] <= lane_reserved_scratch
