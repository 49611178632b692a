"""FlashInfer's plan for a CUDA-graph wrapper, without the host work it does not need: the same plan, buffers and
outputs for about half the host time.

Why: `BatchPrefillWithPagedKVCacheWrapper.plan` (0.6.3) costs 288 us at a c32 draft's shape on the H200 host,
~160 us of it two Python `max()` calls that walk its host tensors element by element. Every graphed
step plans before its replay, and before a draft the device waits for it. Its arguments cannot skip that work:
with `max_token_per_sequence` / `max_sequence_kv` given, it never builds the host arrays its module needs.

What: a wrapper's first plan is FlashInfer's own (it picks the module, fixes the graph's most query rows and
sets every per-wrapper field). Later plans repeat only what changes from step to step, in the same order with
the same values: the four device buffers and the KV lengths are copied, the module's plan is called with the
same arguments, and the two maxima come from the caller's Python lists. Reads private fields, so it runs only
on the version it was read against (`LEAN_PLAN_VERSIONS`) and the fa2 backend; anything else keeps the full
plan. tests/gpu/test_gpu_lean_plan.py checks equal plan info, buffers, work lists and outputs against the full
plan over random batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.errors import UnsupportedConfigError

LEAN_PLAN_VERSIONS = ("0.6.3",)  # FlashInfer versions whose plan() this file repeats field for field


@dataclass(frozen=True)
class PlanArrays:
    """One plan's host arrays (int32, pinned on CUDA) and the maxima taken from the caller's lists."""

    qo_indptr: torch.Tensor  # [b+1]
    kv_indptr: torch.Tensor  # [b+1] in pages
    last_page_len: torch.Tensor  # [b]
    kv_lens: torch.Tensor  # [b]
    indices: torch.Tensor  # [k] page indices, on the device
    total_rows: int
    max_q_len: int
    max_kv_len: int


def lean_plan_supported(wrapper) -> bool:
    """True when `wrapper` (already planned once, the full way) can take lean plans from now on."""
    import flashinfer

    return (
        flashinfer.__version__ in LEAN_PLAN_VERSIONS
        and getattr(wrapper, "is_cuda_graph_enabled", False)
        and getattr(wrapper, "_backend", None) == "fa2"
        and getattr(wrapper, "_jit_module", None) is None
        and getattr(wrapper, "_cached_module", None) is not None
        and getattr(wrapper, "_max_total_num_rows", None) is not None
        and getattr(wrapper, "_custom_mask_buf", None) is None
        and getattr(wrapper, "_prefix_len_ptr", None) is None
    )


def lean_plan(wrapper, a: PlanArrays, heads: tuple[int, int, int], page: int, causal: bool) -> None:
    """Re-plan a CUDA-graph fa2 wrapper for batch `a`, as its full plan would (same checks, copies and module
    call; the fields that only the first plan sets are left as it set them)."""
    b = a.qo_indptr.numel() - 1
    if b != wrapper._fixed_batch_size:
        raise UnsupportedConfigError(f"lean plan: batch {b} on a graph wrapper of batch {wrapper._fixed_batch_size}")
    if a.total_rows > wrapper._max_total_num_rows:
        raise UnsupportedConfigError(
            f"lean plan: {a.total_rows} query rows past the {wrapper._max_total_num_rows} the graph was planned for"
        )
    if a.indices.numel() > wrapper._paged_kv_indices_buf.numel():
        raise UnsupportedConfigError(
            f"lean plan: {a.indices.numel()} page entries past the buffer's {wrapper._paged_kv_indices_buf.numel()}"
        )
    num_qo_heads, num_kv_heads, head_dim = heads
    wrapper._batch_size, wrapper._num_qo_heads, wrapper._num_kv_heads = b, num_qo_heads, num_kv_heads
    wrapper._max_q_len, wrapper._max_kv_len = a.max_q_len, a.max_kv_len
    wrapper._kv_lens_buffer[:b].copy_(a.kv_lens, non_blocking=True)
    wrapper._qo_indptr_buf.copy_(a.qo_indptr, non_blocking=True)
    wrapper._paged_kv_indptr_buf.copy_(a.kv_indptr, non_blocking=True)
    wrapper._paged_kv_last_page_len_buf.copy_(a.last_page_len, non_blocking=True)
    wrapper._paged_kv_indices_buf[: a.indices.numel()].copy_(a.indices, non_blocking=True)
    wrapper._plan_info = wrapper._cached_module.plan(
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
        a.qo_indptr,
        a.kv_indptr,
        a.kv_lens,
        wrapper._max_total_num_rows,
        b,
        num_qo_heads,
        num_kv_heads,
        page,
        True,  # CUDA-graph mode
        head_dim,
        head_dim,
        causal,
        -1,  # window_left
        -1,  # fixed_split_size
        False,  # disable_split_kv
        0,  # num_colocated_ctas
    )
    wrapper._causal = causal
    wrapper._seq_lens_kv = wrapper._seq_lens_q = a.kv_lens
