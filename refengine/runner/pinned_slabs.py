"""Pinned host memory for plain decode steps' tap features, handed out in row blocks of large slabs.

Each plain decode step in adaptive mode copies its features [requests, F*H] to pinned host memory, where they
wait until their request drafts (refengine/spec_decode/pending_rows.py). Those rows outlive the step, so the
caching host allocator cannot hand the same block back, and one pinned allocation per step is a new pinned
allocation per step. Here a step takes the next rows of the current slab (a view); a full slab is followed
by a fresh one, and a slab is freed (returned to torch's host cache) when no view of it is left.
"""

from __future__ import annotations

import torch

SLAB_BYTES = 16 << 20  # per slab: 20 steps of Qwen3-4B features at c32 (5 taps x 2560 x bf16 x 32 rows)


class PinnedSlabs:
    def __init__(self, slab_bytes: int = SLAB_BYTES, pin: bool = True):
        """`pin`: page-locked slabs (CUDA); False for plain host memory (the CPU tests)."""
        if slab_bytes <= 0:
            raise ValueError(f"slab_bytes must be positive, got {slab_bytes}")
        self.slab_bytes, self.pin = slab_bytes, pin
        self._slab: torch.Tensor | None = None  # flat
        self._used = 0  # elements of the current slab handed out
        self.slabs = 0  # slabs allocated so far

    def take(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised [rows, width] host tensor of `dtype`: a view of the current slab, or of a new one."""
        n = rows * width
        slab = self._slab
        if slab is None or slab.dtype != dtype or self._used + n > slab.numel():
            size = max(self.slab_bytes // torch.empty(0, dtype=dtype).element_size(), n)
            slab = self._slab = torch.empty(size, dtype=dtype, pin_memory=self.pin)
            self._used = 0
            self.slabs += 1
        out = slab[self._used : self._used + n].view(rows, width)
        self._used += n
        return out
