"""The feature store: the target's tap-layer features, one row per target KV slot, on the target's device.

Every target forward of a speculating engine writes the tap features [rows, F*H] of every row it runs at the
rows' KV slots, exactly where it writes their K/V: the decode and verify CUDA graphs inside the graph (an
index_copy at the persistent slot buffer, so a plain decode step copies nothing afterwards), eager forwards
right after the forward. The drafter reads a request's committed rows by slot when it drafts: the draft
graph gathers at most B of them inside the graph, a longer stretch (a prompt, many plain steps) is gathered
and projected in chunks before it (DFlashLane._flush_pending: catch-up graph replays in a graph mode).

Why by slot: a row is valid exactly as long as the K/V at that slot is, with no bookkeeping of its own. Rows
of rejected drafts are written and never committed; the next forward at those positions overwrites them,
as it overwrites their K/V. Padding rows of a graphed step write the pool's dummy pages. The store's bytes
are the planner's `pending` term (refengine/memory/reservation.py): F*H*b per token the pool holds.
"""

from __future__ import annotations

import torch

from refengine.errors import AlignmentError
from refengine.kv.pool import KvPool


class FeatureStore:
    def __init__(self, pool: KvPool, width: int, dtype: torch.dtype, device: torch.device):
        self.pool, self.width = pool, width  # the target's KV pool: its slots index the rows
        slots = (pool.num_blocks + len(pool.dummy_blocks)) * pool.page_size
        self.rows = torch.zeros(slots, width, dtype=dtype, device=device)  # [slots, F*H]

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def slots(self, req_id: int, start: int, end: int) -> torch.Tensor:
        """Rows of positions [start, end) of a request (its target KV slots), on the store's device."""
        return self.pool.slots(req_id, start, end).to(self.device, non_blocking=True)

    def write(self, slots: torch.Tensor, feats: torch.Tensor) -> None:
        """feats [rows, F*H] at `slots` [rows] (an eager forward's taps)."""
        if feats.dim() != 2 or feats.shape[1] != self.width or feats.shape[0] != slots.shape[0]:
            raise AlignmentError(
                f"features {list(feats.shape)} for {slots.shape[0]} slots, expected rows of {self.width}"
            )
        self.rows.index_copy_(0, slots.to(self.device), feats.to(self.rows.dtype))

    def put(self, req_id: int, first_position: int, feats: torch.Tensor) -> None:
        """feats [rows, F*H] as a request's positions [first_position, first_position + rows) (tests, tools)."""
        self.write(self.slots(req_id, first_position, first_position + feats.shape[0]), feats)

    def read(self, req_id: int, start: int, end: int) -> torch.Tensor:
        """A request's rows of positions [start, end) [end - start, F*H] (a gather: a copy)."""
        return self.rows.index_select(0, self.slots(req_id, start, end))

    def bytes_per_token(self) -> int:
        return self.width * self.rows.element_size()
