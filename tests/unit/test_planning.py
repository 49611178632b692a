"""The GPU pool planner's code path, run on the CPU with the three CUDA-only calls faked (device memory
reading, the peak-memory profiler, the allocator cap): it must run the worst-case forward it claims to
profile (the largest of max_prefill_tokens, the context and the verify batch, with the worst logits
read-out), hand the measurement to the planner, and cap the allocator at the planned share.

Run: pytest tests/unit/test_planning.py
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import refengine.runner.planning as planning
from refengine.config import DFlashConfig, read_config_json
from refengine.memory_plan import DeviceMemory
from tests.adapter import cpu_engine


@pytest.mark.parametrize("max_prefill_tokens,max_num_seqs,expected_rows", [
    (64, 4, 2032),      # one prompt of the whole context (2048 - 16), admitted alone past the chunk
    (4096, 4, 4096),    # a prefill chunk longer than the context: several requests, none past its window
    (64, 300, 4800)])   # every running request's verify span
def test_plan_pool_profiles_the_worst_forward(random_pair, monkeypatch, max_prefill_tokens, max_num_seqs,
                                             expected_rows):
    engine = cpu_engine(random_pair.target, random_pair.draft, max_prefill_tokens=max_prefill_tokens,
                        max_num_seqs=max_num_seqs)
    ran = {}

    def fake_profile(step, device, temporary_kv_bytes=0):
        forward = engine.target.forward

        def spy(ids, batch, *a, **k):
            ran["rows"], ran["capture"] = ids.shape[0], a[2] if len(a) > 2 else k.get("capture_layers")
            return forward(ids, batch, *a, **k)
        monkeypatch.setattr(engine.target, "forward", spy)
        step()
        monkeypatch.setattr(engine.target, "forward", forward)
        assert temporary_kv_bytes == 0, "the temporary KV predates the baseline: nothing to subtract"
        return SimpleNamespace(non_kv_peak_increase_bytes=123_456)

    caps = []
    monkeypatch.setattr(planning, "profile_activation_peak", fake_profile)
    monkeypatch.setattr(planning, "read_device_memory", lambda dev: DeviceMemory(8 << 30, 6 << 30, "fake 8 GiB"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 1 << 30)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, dev=None: caps.append(f))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    draft_cfg = DFlashConfig.from_hf(read_config_json(random_pair.draft))
    plan = planning.plan_pool(engine, draft_cfg)
    assert ran["rows"] == expected_rows and tuple(ran["capture"]) == draft_cfg.target_layer_ids
    assert plan.activation_peak_bytes == 123_456 and plan.used_bytes == 2 << 30 and plan.dflash
    assert engine.kv_plan_outside_torch_bytes == 1 << 30
    assert caps == [pytest.approx((plan.requested_bytes - (1 << 30)) / (8 << 30))]
