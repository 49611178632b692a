"""Helpers to measure what the DFlash lane really holds (shared by the CPU and GPU memory tests)."""
from __future__ import annotations


def lane_persistent_bytes(lane) -> int:
    """Bytes of every live request's drafter context K/V buffers plus its pending target features."""
    total = 0
    for ctx in lane._ctx.values():
        total += sum(t.numel() * t.element_size() for t in ctx.k + ctx.v)
        total += sum(f.numel() * f.element_size() for f in ctx.pending)
    return total
