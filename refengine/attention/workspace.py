"""How large a FlashInfer float workspace must be: an upper bound on what flashinfer 0.6.3's fa2 paged-prefill
plan takes from it, for any plan up to a wrapper's maxima.

Read from FlashInfer 0.6.3 (include/flashinfer/attention/scheduler.cuh `PrefillPlan`, `PrefillSplitQOKVIndptr`;
include/flashinfer/utils.cuh `FA2DetermineCtaTileQ`; python/flashinfer/prefill.py `plan`). A plan takes float
workspace only when it splits the KV, and then two arrays, each 16-byte aligned:

    tmp_v  num_qo_heads x padded_batch_size x cta_tile_q x head_dim  float32
    tmp_s  num_qo_heads x padded_batch_size x cta_tile_q             float32

- cta_tile_q (query rows a CTA takes, GQA-packed) is 16, 64 or 128; at most 64 where head_dim >= 256.
- The split cap is max_batch_size_if_split = 2 CTAs per SM x SMs // num_kv_heads.
- A CUDA-graph wrapper always splits. Its plans use the rows of its first plan (`_max_total_num_rows`: the
  engine plans a graph's bucket at its most rows first) and its fixed batch, and pad the work list to
  max(split cap, ceil(rows x group / cta_tile_q) + batch - 1) tiles, group = q heads per KV head. So
  padded_batch_size x cta_tile_q <= max(split cap x cta_tile_q, rows x group + batch x cta_tile_q).
- An eager wrapper splits only when the KV chunking fits the split cap: padded_batch_size <= split cap,
  whatever its rows.

At Qwen3-4B shapes (32 q / 8 KV heads, head_dim 128) a graph bucket of 88 requests x 16 verify rows pads to 131
tiles of 128 rows: tmp_v is 274,726,912 bytes (past 256 MiB); 256 x 16 rows pad to 383 tiles, 803 MB.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from refengine.config import ModelConfig
from refengine.errors import UnsupportedConfigError

# A floor under the bound: a plan this model of FlashInfer misses (another version or backend) still fits up to
# here; small shapes keep a workspace of this size.
FLOAT_WORKSPACE_FLOOR_BYTES = 256 << 20
CTAS_PER_SM = 2  # PrefillPlan's num_blocks_per_sm: the split cap's CTAs per SM
ALIGNMENT = 16  # each array's alignment in the workspace
FLOAT32_BYTES = 4


def max_cta_tile_q(head_dim: int) -> int:
    """The most query rows FA2DetermineCtaTileQ gives a CTA at this head_dim."""
    return 128 if head_dim < 256 else 64


def flashinfer_float_workspace_bytes(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    graph_rows: int = 0,
    graph_batch: int = 0,
) -> int:
    """Bytes of float workspace that hold any fa2 paged-prefill plan of these heads on a device of `num_sms`
    SMs. A CUDA-graph wrapper passes `graph_rows` and `graph_batch`, the rows and batch of its first plan (the
    largest it will make); an eager wrapper leaves them 0: its split is capped by the SMs alone."""
    counts = (num_qo_heads, num_kv_heads, head_dim, num_sms)
    if min(counts) <= 0 or min(graph_rows, graph_batch) < 0 or num_qo_heads % num_kv_heads:
        raise UnsupportedConfigError(
            f"FlashInfer workspace for {num_qo_heads} q / {num_kv_heads} KV heads, head_dim {head_dim}, {num_sms} "
            f"SMs, graph rows {graph_rows} / batch {graph_batch}: heads, head_dim and SMs must be positive, graph "
            "rows and batch >= 0, the q heads a multiple of the KV heads"
        )
    tile = max_cta_tile_q(head_dim)
    split_cap = CTAS_PER_SM * num_sms // num_kv_heads
    # padded_batch_size x cta_tile_q, bounded above (module docstring)
    tile_rows = max(split_cap * tile, graph_rows * (num_qo_heads // num_kv_heads) + graph_batch * tile)
    tmp_v = num_qo_heads * tile_rows * head_dim * FLOAT32_BYTES
    tmp_s = num_qo_heads * tile_rows * FLOAT32_BYTES
    return max(FLOAT_WORKSPACE_FLOOR_BYTES, tmp_v + tmp_s + 2 * ALIGNMENT)


def graph_float_workspace_bytes(max_batch: int, span: int, models: Iterable[ModelConfig], num_sms: int) -> int:
    """The one float workspace an engine's CUDA-graph wrappers share on a device: the largest first plan of any
    of them, the largest bucket (`max_batch` requests) of each model (target, drafter) at `span` rows a request
    (the verify span and the drafter's block; decode's one row a request plans less)."""
    return max(
        flashinfer_float_workspace_bytes(
            m.num_heads, m.num_kv_heads, m.head_dim, num_sms, graph_rows=max_batch * span, graph_batch=max_batch
        )
        for m in models
    )


def device_sm_count(device: torch.device | str) -> int:
    """SMs of a CUDA device: FlashInfer's plans split the KV over 2 CTAs per SM."""
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
