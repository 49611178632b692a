"""FlashInfer float workspace sizing (refengine/attention/workspace.py) and its billing, on the CPU.

Checks:
* the bound holds every plan, against `fa2_graph_plan` / `fa2_eager_plan`: flashinfer 0.6.3's fa2 paged-prefill
  plan arithmetic restated (PrefillSplitQOKVIndptr / PrefillPlan: tmp_v + tmp_s), whose 88 x 16-row graph plan
  at Qwen3-4B heads takes 274,726,912 bytes of tmp_v, the figure FlashInfer's overflow error gives; over every
  graph bucket and row cap up to 256 requests, several head shapes and SM counts, and for eager wrappers (split cap);
* 128 x 16 verify rows at 32 q / 8 KV heads, head_dim 128, get the 274,726,912 bytes and more (the plan at
  128 requests is larger still); the bound grows with rows, batch, q heads and head_dim, and has a floor;
* the memory planner bills the graph wrappers' shared workspace (graph_pool_bytes) and the drafter lane's eager
  one (plan_device_pool), with the CUDA-only reads faked.

Run: pytest tests/unit/test_flashinfer_workspace.py
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import refengine.memory.profile as profile
from refengine.attention.workspace import (
    FLOAT_WORKSPACE_FLOOR_BYTES,
    flashinfer_float_workspace_bytes,
    graph_float_workspace_bytes,
)
from refengine.config import DFlashConfig, EngineConfig, ModelConfig, read_config_json
from refengine.errors import UnsupportedConfigError
from refengine.memory.planner import DeviceMemory
from refengine.runner.shapes import batch_buckets, row_caps

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
TARGET, DRAFT = CONFIGS / "qwen3-4b", CONFIGS / "qwen3-4b-dflash-b16"
H100_SMS = 132
CRASH_BYTES = 274_726_912  # FlashInfer's overflow error for batch_prefill_tmp_v: Qwen3-4B heads, 88 x 16 rows
HEAD_SHAPES = [(32, 8, 128), (4, 1, 128), (16, 16, 64), (40, 8, 128), (64, 8, 256), (8, 2, 256)]


def fa2_graph_plan(rows: int, batch: int, heads: int, kv_heads: int, head_dim: int, sms: int) -> tuple[int, int]:
    """(tmp_v, tmp_s) bytes of FlashInfer 0.6.3's fa2 plan in a CUDA-graph wrapper first planned at `rows` rows
    of `batch` requests: the work list is padded to max(split cap, ceil(rows x group / tile) + batch - 1)
    tiles, the tile picked from the longest request such a plan allows (rows - batch + 1, GQA-packed)."""
    group, cap = heads // kv_heads, 2 * sms // kv_heads
    packed = (rows - batch + 1) * group
    tile = 128 if packed > 64 and head_dim < 256 else 64 if packed > 16 else 16
    padded = max(cap, math.ceil(rows * group / tile) + batch - 1)
    return heads * padded * tile * head_dim * 4, heads * padded * tile * 4


def fa2_eager_plan(heads: int, kv_heads: int, head_dim: int, sms: int) -> tuple[int, int]:
    """(tmp_v, tmp_s) bytes of the largest eager fa2 plan that splits the KV: at most the split cap of work
    items, at the largest tile (a long prefill's)."""
    cap, tile = 2 * sms // kv_heads, 128 if head_dim < 256 else 64
    return heads * cap * tile * head_dim * 4, heads * cap * tile * 4


def test_the_overflow_figure_is_what_flashinfer_plans_and_the_bound_holds_it():
    tmp_v, _ = fa2_graph_plan(88 * 16, 88, 32, 8, 128, H100_SMS)
    assert tmp_v == CRASH_BYTES, f"the restated plan gives tmp_v {tmp_v:,}, the crash asked {CRASH_BYTES:,}"
    at_128 = sum(fa2_graph_plan(128 * 16, 128, 32, 8, 128, H100_SMS))
    bound = flashinfer_float_workspace_bytes(32, 8, 128, H100_SMS, graph_rows=128 * 16, graph_batch=128)
    assert bound >= at_128 > CRASH_BYTES > 256 << 20, f"bound {bound:,}, plan {at_128:,}, crash {CRASH_BYTES:,}"
    assert bound - at_128 < at_128 // 8, f"bound {bound:,} for a plan of {at_128:,}: loose by over 1/8"


@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("sms", [78, 114, H100_SMS, 148])
def test_the_bound_holds_every_graph_and_eager_plan(heads, kv_heads, head_dim, sms):
    failures = []
    for span in (1, 2, 4, 16, 32):
        for batch in batch_buckets(256):
            for cap in row_caps(span) if span > 1 else (1,):
                rows = batch * cap
                plan = sum(fa2_graph_plan(rows, batch, heads, kv_heads, head_dim, sms))
                got = flashinfer_float_workspace_bytes(heads, kv_heads, head_dim, sms, rows, batch)
                if got < plan + 32:  # + two 16-byte alignments
                    failures.append(f"{batch} x {cap} rows: bound {got:,} < plan {plan:,} + 32")
    eager = sum(fa2_eager_plan(heads, kv_heads, head_dim, sms))
    got = flashinfer_float_workspace_bytes(heads, kv_heads, head_dim, sms)
    if got < eager + 32:
        failures.append(f"eager: bound {got:,} < plan {eager:,} + 32")
    assert not failures, "\n".join(failures[:20])


def test_the_engine_wide_bound_holds_every_wrapper_of_target_and_drafter():
    target = ModelConfig.from_hf(read_config_json(TARGET))
    small = ModelConfig.from_hf({**read_config_json(DRAFT), "num_attention_heads": 8, "num_key_value_heads": 1})
    for max_batch in (1, 7, 88, 256):
        shared = graph_float_workspace_bytes(max_batch, 16, [target, small], H100_SMS)
        for cfg in (target, small):
            for batch in batch_buckets(max_batch):
                for cap in (1, *row_caps(16)):  # decode, verify caps (the drafter's blocks: 16 rows)
                    shape = (batch * cap, batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, H100_SMS)
                    plan = sum(fa2_graph_plan(*shape))
                    assert shared >= plan + 32, f"max_num_seqs {max_batch}: {batch} x {cap} plans {plan:,} > {shared:,}"


def test_the_bound_grows_with_rows_batch_heads_and_head_dim_and_has_a_floor():
    def size(rows=4096, batch=256, heads=32, kv=8, head_dim=128):
        return flashinfer_float_workspace_bytes(heads, kv, head_dim, H100_SMS, graph_rows=rows, graph_batch=batch)

    base = size()
    grown = {
        "rows": size(rows=8192),
        "batch": size(batch=512),
        "q heads": size(heads=64),
        "head_dim": size(head_dim=192),
    }
    assert all(v > base for v in grown.values()), f"base {base:,}, grown {grown}"
    rows = [size(rows=r, batch=1) for r in range(1, 20000, 997)]
    assert rows == sorted(rows), f"not monotone in rows: {rows}"
    assert size(rows=16, batch=1, heads=4, kv=1) == FLOAT_WORKSPACE_FLOOR_BYTES
    assert flashinfer_float_workspace_bytes(4, 1, 128, H100_SMS) == FLOAT_WORKSPACE_FLOOR_BYTES
    # eager: the split cap bounds it whatever the rows a plan carries
    assert flashinfer_float_workspace_bytes(64, 1, 128, H100_SMS) > FLOAT_WORKSPACE_FLOOR_BYTES


@pytest.mark.parametrize(
    "args", [(0, 1, 128, 132), (32, 8, 0, 132), (32, 8, 128, 0), (30, 8, 128, 132), (32, 8, 128, 132, -1, 1)]
)
def test_impossible_shapes_are_refused(args):
    with pytest.raises(UnsupportedConfigError, match="FlashInfer workspace for"):
        flashinfer_float_workspace_bytes(*args)


def _fake_cuda(monkeypatch):
    """The planner's CUDA-only reads: SMs, device memory, torch's reserved bytes, the profiled forward."""
    monkeypatch.setattr(profile, "device_sm_count", lambda dev: H100_SMS)
    monkeypatch.setattr(profile, "profile_step", lambda *a, **k: 1 << 30)
    monkeypatch.setattr(profile, "read_device_memory", lambda dev: DeviceMemory(80 << 30, 70 << 30, "fake 80 GiB"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 1 << 30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def _plan(backend: str, graph_mode: str):
    target_cfg = ModelConfig.from_hf(read_config_json(TARGET))
    draft_cfg = DFlashConfig.from_hf(read_config_json(DRAFT))
    # only the geometry, dtype and device are read: no 8 GB of weights
    target = SimpleNamespace(cfg=target_cfg, dtype=torch.bfloat16, device=torch.device("cuda"))
    config = EngineConfig(
        str(TARGET),
        draft_path=str(DRAFT),
        device="cuda",
        attention_backend=backend,
        graph_mode=graph_mode,
        max_num_seqs=256,
        max_model_len=4096,
    )
    graphs = profile.graph_pool_bytes(target, config, draft_cfg, 4096)
    return graphs, profile.plan_device_pool(target, config, draft_cfg, 4096)


def test_the_planner_bills_the_graph_and_lane_workspaces(monkeypatch):
    _fake_cuda(monkeypatch)
    target_cfg = ModelConfig.from_hf(read_config_json(TARGET))
    drafter = DFlashConfig.from_hf(read_config_json(DRAFT)).model
    shared = graph_float_workspace_bytes(256, 16, [target_cfg, drafter], H100_SMS)
    lane = flashinfer_float_workspace_bytes(drafter.num_heads, drafter.num_kv_heads, drafter.head_dim, H100_SMS)
    int_workspaces = 3 * len(batch_buckets(256)) * profile.FLASHINFER_INT_WORKSPACE_BYTES
    assert shared >= sum(fa2_graph_plan(256 * 16, 256, 32, 8, 128, H100_SMS)) > 2 * CRASH_BYTES

    graphs_fi, plan_fi = _plan("flashinfer", "full")
    graphs_torch, plan_torch = _plan("torch", "full")
    assert graphs_fi - graphs_torch == shared + int_workspaces, (
        f"graph pool billed {graphs_fi - graphs_torch:,} more with FlashInfer; expected {shared:,} + {int_workspaces:,}"
    )
    assert plan_fi.graph_pool_bytes == graphs_fi
    extra = plan_fi.activation_peak_bytes - plan_torch.activation_peak_bytes
    assert extra == shared + int_workspaces + lane, f"billed {extra:,}, expected {shared + int_workspaces + lane:,}"
    assert plan_fi.num_blocks < plan_torch.num_blocks

    _, eager_fi = _plan("flashinfer", "eager")
    _, eager_torch = _plan("torch", "eager")
    extra = eager_fi.activation_peak_bytes - eager_torch.activation_peak_bytes
    assert extra == lane, f"eager: billed {extra:,} more with FlashInfer, the lane's workspace is {lane:,}"
