"""What the DFlash lane asks of whoever runs its drafting on captured graphs (the runner's
runner/draft_graphs.py): the lane describes the work (each request's block and the pending context rows its
draft projects first; catch-up chunks of rows carried past a prompt or span-1 steps) and the executor runs it.
The lane holds no graph: without an executor (eager mode, the CPU default) it drafts eagerly itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from refengine.spec_decode.proposer import LaunchedDrafts


@dataclass(frozen=True)
class DraftBlock:
    """One request's block: `tokens` (B of them: the current token, then MASK) at positions [start, start + B),
    after its pending context rows: their positions, drafter-pool slots and feature-store slots (sources)."""

    req_id: int
    start: int
    tokens: list[int]
    positions: list[int]
    slots: list[int]
    sources: list[int]


class DraftExecutor(Protocol):
    @property
    def catch_up_rows(self) -> int:
        """The most rows one `project` call takes."""
        ...

    def fits(self, n: int) -> bool:
        """Whether a draft of n requests runs on a graph."""
        ...

    def project(self, sources: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Project n <= catch_up_rows context rows (host int64 [n] each): features gathered from the store at
        `sources`, K/V written into the drafter pool at `slots` for `positions`."""
        ...

    def draft(self, blocks: list[DraftBlock], spans: list[int], widest: int) -> LaunchedDrafts:
        """Queue the draft of `blocks` (each block's pending context projected first), scoring at least the
        `widest` span's drafts; the drafts stay on the device."""
        ...
