"""Pending drafter context rows held off the device: target features [rows, F*H] that were committed but not
yet projected into the drafter's KV, in position order.

The tap features of a plain decode step (every span 1) are copied to pinned host memory
(`ModelRunner._replay`). A device-to-device copy between decode-graph replays slowed the next replay on the
H200. Such rows stay on the host until the request drafts. A long plain stretch must not grow host memory
without bound, so past HOST_PENDING_BYTES per lane the host rows move to the device. That costs one copy per
run of host rows, and no kernels. The device has room for them: the planner bills every request's pending
rows for its whole capacity (refengine/memory/reservation.py, `pending Ht*n*b` per token).
"""

from __future__ import annotations

import torch

HOST_PENDING_BYTES = 1 << 30  # per lane: ~42k rows of Qwen3-4B features (5 taps x 2560 x bf16)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def runs_to_device(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`parts` in order, each run of consecutive parts on another device moved to `device` as one tensor."""
    out: list[torch.Tensor] = []
    run: list[torch.Tensor] = []

    def move_run() -> None:
        if run:
            out.append((run[0] if len(run) == 1 else torch.cat(run)).to(device))
            run.clear()

    for f in parts:
        if f.device != device:
            run.append(f)
        else:
            move_run()
            out.append(f)
    move_run()
    return out


def on_device(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The rows of `parts`, in order, as one tensor on `device`."""
    moved = runs_to_device(parts, device)
    return moved[0] if len(moved) == 1 else torch.cat(moved)
