"""Pinned slabs (refengine/runner/pinned_slabs.py): plain decode steps' host rows are consecutive views of one
slab until it is full, then of a new one; a request bigger than a slab gets a slab of its own; a slab lives
as long as a view of it does. Unpinned on the CPU (pin=False): the slicing is what is checked here, the pinned
copies by the GPU tests (test_gpu_decode_features_on_the_host_give_the_same_drafts).

Run: pytest tests/unit/test_pinned_slabs.py
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from refengine.runner.pinned_slabs import PinnedSlabs


def test_steps_share_a_slab_until_it_is_full():
    slabs = PinnedSlabs(slab_bytes=10 * 4 * 4, pin=False)  # 10 rows of 4 fp32
    a, b = slabs.take(3, 4, torch.float32), slabs.take(7, 4, torch.float32)
    assert slabs.slabs == 1 and a.shape == (3, 4) and b.shape == (7, 4)
    assert b.data_ptr() == a.data_ptr() + 3 * 4 * 4, "the next step's rows follow the last step's"
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.sum().item() == 12.0, "rows of two steps must not overlap"
    c = slabs.take(1, 4, torch.float32)
    assert slabs.slabs == 2 and c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    big = slabs.take(25, 4, torch.float32)  # more than a slab: a slab of its own size
    assert slabs.slabs == 3 and big.shape == (25, 4)
    half = slabs.take(2, 4, torch.bfloat16)  # another dtype starts a new slab
    assert slabs.slabs == 4 and half.dtype == torch.bfloat16


def test_a_slab_lives_while_a_view_does():
    slabs = PinnedSlabs(slab_bytes=4 * 4 * 4, pin=False)
    row = slabs.take(1, 4, torch.float32)
    first = slabs._slab
    slabs.take(4, 4, torch.float32)  # the first slab is full: a new one
    assert slabs._slab is not first
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is not None, "the first slab is freed while a view of it is alive"
    del row
    gc.collect()
    assert ref() is None, "the first slab outlives its last view"


def test_bad_slab_size_is_refused():
    with pytest.raises(ValueError, match="slab_bytes must be positive, got 0"):
        PinnedSlabs(slab_bytes=0)
