"""The step shapes CUDA graphs are captured at (refengine/runner/graphs.py): batch buckets, and the row caps of
a verify (rows per request) or a draft (its score caps: rows scored a block, runner/graph_setup.py)."""

from __future__ import annotations


def row_caps(span: int) -> tuple[int, ...]:
    """Rows per request of the verify shapes: powers of two from 2 below `span`, then `span` itself."""
    caps, c = [], 2
    while c < span:
        caps.append(c)
        c *= 2
    return tuple(caps + [span])


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (max_batch itself always included)."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(out + [max_batch]))
