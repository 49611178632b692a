"""Block allocator and KV pool invariants, as hypothesis property tests, plus the speculative transaction
(all-or-nothing reservation, commit, last-in-first-out rollback).

Run: pytest tests/unit/test_kv_allocator.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine.errors import IntegrityError, KvAllocationError
from refengine.kv import BlockAllocator, KvPool

ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free_tail", "free_req"]), st.integers(0, 4), st.integers(0, 6)), max_size=60
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24), ops=ops)
def test_allocator_integrity_under_random_ops(num_blocks, ops):
    a = BlockAllocator(num_blocks)
    for op, req, n in ops:
        before_free = a.num_free
        if op == "alloc":
            if n > a.num_free:
                with pytest.raises(KvAllocationError):
                    a.allocate(req, n)
                assert a.num_free == before_free, "a failed allocation must allocate nothing"
            else:
                got = a.allocate(req, n)
                assert len(got) == n and a.table(req)[-n:] == got if n else True
        elif op == "free_tail":
            if n > len(a.table(req)):
                with pytest.raises(KvAllocationError):
                    a.free_tail(req, n)
            else:
                tail = a.table(req)[len(a.table(req)) - n :]
                a.free_tail(req, n)
                assert a.num_free == before_free + n
                if n:  # LIFO: the freed tail is what the next allocation hands out first
                    assert a.allocate(99, 1) == [tail[0]]
                    a.free_tail(99, 1)
        else:
            owned = len(a.table(req))
            a.free_request(req)
            assert a.num_free == before_free + owned and a.table(req) == []
        a.check_integrity()


def test_integrity_check_detects_double_ownership():
    a = BlockAllocator(4)
    a.allocate(0, 2)
    a.allocate(1, 1)
    a.table(1)[0] = a.table(0)[0]  # corrupt through the live table: one block owned twice, one lost
    with pytest.raises(IntegrityError, match="twice"):
        a.check_integrity()


def _pool(blocks=8, page=4):
    return KvPool(
        num_layers=1,
        num_blocks=blocks,
        page_size=page,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.integers(1, 9), min_size=1, max_size=4), spans=st.data())
def test_speculative_transaction_commits_and_rolls_back(prompts, spans):
    pool = _pool(blocks=64)  # 4 requests x ceil((9 + 32) / 4) = 44 blocks at most
    for r, p in enumerate(prompts):
        pool.admit(r, p + 4 * 8)  # lifetime covers four full spans
        pool.extend(r, p)
    for _ in range(4):
        span = {r: spans.draw(st.integers(1, 8)) for r in range(len(prompts))}
        before = {r: (pool.seq_len[r], len(pool.allocator.table(r))) for r in span}
        res = pool.schedule_speculative(span)
        for r, start, s in pool.speculative_view(res):
            assert start == before[r][0] and s == span[r]
            assert len(pool.allocator.table(r)) * 4 >= start + s, "the reservation must cover the whole span"
        commits = {r: spans.draw(st.integers(1, span[r])) for r in span}
        for r, c in commits.items():
            pool.apply_speculative(r, c, res)
        pool.revert_schedule(res)
        for r, c in commits.items():
            assert pool.seq_len[r] == before[r][0] + c
            assert len(pool.allocator.table(r)) == -(-pool.seq_len[r] // 4), "rollback must free the unused tail"
        pool.check_integrity()


def test_schedule_speculative_is_all_or_nothing():
    pool = _pool(blocks=4, page=4)
    pool.admit(0, 8)
    pool.admit(1, 8)
    pool.extend(0, 4)
    pool.extend(1, 4)
    pool.allocator.allocate(77, 1)  # outside pressure: only one block left for two requests that need one each
    free, tables = pool.allocator.num_free, {r: list(pool.allocator.table(r)) for r in (0, 1)}
    with pytest.raises(KvAllocationError):
        pool.schedule_speculative({0: 4, 1: 4})
    assert pool.allocator.num_free == free, "a refused reservation must allocate nothing"
    assert {r: pool.allocator.table(r) for r in (0, 1)} == tables
    pool.allocator.check_integrity()


def test_admission_respects_outstanding_promises():
    pool = _pool(blocks=4, page=4)
    assert pool.can_admit(16)
    pool.admit(0, 12)  # promises 3 blocks, allocates none yet
    assert pool.can_admit(4) and not pool.can_admit(5)
    pool.release(0)
    assert pool.can_admit(16)
