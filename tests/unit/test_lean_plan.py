"""The lean FlashInfer plan's host side (refengine/attention/lean_plan.py) on the CPU, against a stand-in wrapper
whose module records its plan call: the buffers it copies, the module call's arguments in flashinfer 0.6.3's fa2
order (what FlashInfer's own plan passes; tests/gpu/test_gpu_lean_plan.py checks the result against the real
plan on CUDA), the fields it sets, and its refusals (a batch other than the graph's, more query rows than the
first plan fixed, more page entries than the buffer), each a typed error naming the numbers.

Run: python -m pytest tests/unit/test_lean_plan.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refengine.attention.lean_plan import PlanArrays, lean_plan
from refengine.errors import UnsupportedConfigError

HEADS = (32, 8, 128)
PAGE = 16


def _wrapper(batch: int = 2, max_rows: int = 32, pages: int = 10):
    calls: list[tuple] = []
    i32 = torch.int32
    return SimpleNamespace(
        _fixed_batch_size=batch,
        _max_total_num_rows=max_rows,
        _qo_indptr_buf=torch.zeros(batch + 1, dtype=i32),
        _paged_kv_indptr_buf=torch.zeros(batch + 1, dtype=i32),
        _paged_kv_last_page_len_buf=torch.zeros(batch, dtype=i32),
        _paged_kv_indices_buf=torch.zeros(pages, dtype=i32),
        _kv_lens_buffer=torch.zeros(batch, dtype=i32),
        _float_workspace_buffer="float ws",
        _int_workspace_buffer="int ws",
        _pin_memory_int_workspace_buffer="pinned ws",
        _cached_module=SimpleNamespace(plan=lambda *a: calls.append(a) or ("plan info", len(calls))),
    ), calls


def _arrays(q_lens: list[int], kv_lens: list[int]) -> PlanArrays:
    n_pages = [-(-kv // PAGE) for kv in kv_lens]
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv = torch.tensor([0, *torch.tensor(n_pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([(n - 1) % PAGE + 1 for n in kv_lens], dtype=torch.int32)
    indices = torch.arange(sum(n_pages), dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    return PlanArrays(qo, kv, last, lens, indices, sum(q_lens), max(q_lens), max(kv_lens))


def test_a_lean_plan_copies_the_buffers_and_calls_the_module_as_flashinfer_does():
    w, calls = _wrapper()
    a = _arrays([5, 16], [40, 17])
    lean_plan(w, a, HEADS, PAGE, causal=True)
    for name, buf, want in (
        ("qo indptr", w._qo_indptr_buf, a.qo_indptr),
        ("kv indptr", w._paged_kv_indptr_buf, a.kv_indptr),
        ("last page lens", w._paged_kv_last_page_len_buf, a.last_page_len),
        ("kv lens", w._kv_lens_buffer, a.kv_lens),
        ("page indices", w._paged_kv_indices_buf[: a.indices.numel()], a.indices),
    ):
        assert torch.equal(buf, want), f"{name}: {buf.tolist()} != {want.tolist()}"
    assert len(calls) == 1
    args = calls[0]
    want_scalars = [32, 2, 32, 8, PAGE, True, 128, 128, True, -1, -1, False, 0]  # rows .. num_colocated_ctas
    assert args[:3] == ("float ws", "int ws", "pinned ws")
    assert args[3] is a.qo_indptr and args[4] is a.kv_indptr and args[5] is a.kv_lens
    assert list(args[6:]) == want_scalars, f"module plan scalars {list(args[6:])}, 0.6.3's fa2 order {want_scalars}"
    assert w._plan_info == ("plan info", 1)
    assert (w._max_q_len, w._max_kv_len, w._batch_size, w._causal) == (16, 40, 2, True)
    assert w._seq_lens_kv is a.kv_lens and w._seq_lens_q is a.kv_lens


@pytest.mark.parametrize(
    "wrapper_kw,q_lens,kv_lens,message",
    [
        ({"batch": 3}, [1, 1], [4, 4], "batch 2 on a graph wrapper of batch 3"),
        ({"max_rows": 8}, [5, 16], [40, 17], "21 query rows past the 8"),
        ({"pages": 4}, [1, 1], [40, 17], "5 page entries past the buffer's 4"),
    ],
)
def test_a_lean_plan_refuses_what_the_graph_cannot_hold(wrapper_kw, q_lens, kv_lens, message):
    w, calls = _wrapper(**wrapper_kw)
    with pytest.raises(UnsupportedConfigError, match=message):
        lean_plan(w, _arrays(q_lens, kv_lens), HEADS, PAGE, causal=True)
    assert not calls, "refused plans must not reach the module"
