"""The GPU pool planner's code path, run on the CPU with the CUDA-only calls faked (device memory reading,
the peak-memory profiler, torch's reserved bytes): `plan_device_pool` is a function of (target, config,
drafter config, context) alone; it must run the worst-case forward it claims to profile (the largest of
max_prefill_tokens, the context and the verify batch at the drafter's block size, with the worst logits
read-out), hand the measurement to the planner, and put the bytes held outside torch into the plan.

Run: pytest tests/unit/test_planning.py
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import refengine.memory.profile as profile
from refengine.config import DFlashConfig, EngineConfig, max_context_tokens, read_config_json
from refengine.memory.planner import DeviceMemory
from refengine.models.qwen3 import Qwen3Model


@pytest.mark.parametrize(
    "max_prefill_tokens,max_num_seqs,block_size,expected_rows",
    [
        (64, 4, 16, 2032),  # one prompt of the whole context (2048 - 16), admitted alone past the chunk
        (4096, 4, 16, 4096),  # a prefill chunk longer than the context: several requests, none past its window
        (64, 300, 16, 4800),  # every running request's verify span
        (64, 300, 32, 9600),
    ],
)  # ... at the drafter's own block size, not a hard-coded 16
def test_plan_device_pool_profiles_the_worst_forward(
    random_pair, monkeypatch, max_prefill_tokens, max_num_seqs, block_size, expected_rows
):
    target = Qwen3Model.load(random_pair.target)
    config = EngineConfig(
        str(random_pair.target),
        draft_path=str(random_pair.draft),
        max_prefill_tokens=max_prefill_tokens,
        max_num_seqs=max_num_seqs,
    )
    draft_cfg = dataclasses.replace(DFlashConfig.from_hf(read_config_json(random_pair.draft)), block_size=block_size)
    context = max_context_tokens(target.cfg, draft_cfg)
    ran = {}

    def fake_profile(step, device, temporary_kv_bytes=0):
        forward = target.forward

        def spy(ids, batch, *a, **k):
            ran["rows"], ran["capture"] = ids.shape[0], a[2] if len(a) > 2 else k.get("capture_layers")
            return forward(ids, batch, *a, **k)

        monkeypatch.setattr(target, "forward", spy)
        step()
        monkeypatch.setattr(target, "forward", forward)
        assert temporary_kv_bytes == 0, "the temporary KV predates the baseline: nothing to subtract"
        return SimpleNamespace(non_kv_peak_increase_bytes=123_456)

    monkeypatch.setattr(profile, "profile_activation_peak", fake_profile)
    monkeypatch.setattr(profile, "read_device_memory", lambda dev: DeviceMemory(8 << 30, 6 << 30, "fake 8 GiB"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 1 << 30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    plan = profile.plan_device_pool(target, config, draft_cfg, context)
    assert ran["rows"] == expected_rows and tuple(ran["capture"]) == draft_cfg.target_layer_ids
    assert plan.activation_peak_bytes == 123_456 and plan.used_bytes == 2 << 30 and plan.dflash
    assert plan.outside_torch_bytes == 1 << 30
    assert plan.allocator_cap_fraction == pytest.approx((plan.requested_bytes - (1 << 30)) / (8 << 30))
