"""Pending drafter context rows held off the device: target features [rows, F*H] that were committed but not
yet projected into the drafter's KV, in position order.

A pending part is either a tensor of consecutive rows (a prefill's or a verify's, on the device) or a
`DecodeRow`: row i of one plain decode step's features, the step's tensor shared by every request in it. A
decode step is committed in one call per step (DFlashLane.commit_step) and a per-request row view is made
only when the row is projected: views cost about a microsecond each on the host, every step, per request.

The tap features of a plain decode step (every span 1) are copied to pinned host memory
(`ModelRunner._replay`). A device-to-device copy between decode-graph replays slowed the next replay on the
H200. Such rows stay on the host until the request drafts. A long plain stretch must not grow host memory
without bound, so past HOST_PENDING_BYTES per lane the host rows move to the device. That costs one copy per
step tensor or run of host rows, and no kernels. The device has room for them: the planner bills every
request's pending rows for its whole capacity (refengine/memory/reservation.py, `pending Ht*n*b` per token).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

HOST_PENDING_BYTES = 1 << 30  # per lane: ~42k rows of Qwen3-4B features (5 taps x 2560 x bf16)
MIN_STEP_ROWS = 8  # a step tensor of fewer rows is gathered row by row: its bytes are few, copies many


class DecodeRow(NamedTuple):
    """Row `row` of a decode step's features `step` [requests, F*H] (one request's row of that step)."""

    step: torch.Tensor
    row: int


Part = torch.Tensor | DecodeRow  # pending rows: consecutive rows [n, F*H], or one decode step's row
Moved = dict[int, torch.Tensor]  # id of a host step tensor -> its copy on the device (one flush's cache)
OffDevice = Callable[[torch.Tensor], bool]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def part_rows(p: Part) -> int:
    return 1 if isinstance(p, DecodeRow) else p.shape[0]


def part_nbytes(p: Part) -> int:
    """Bytes the part's rows take (a step row: its share of the step tensor)."""
    return p.step.shape[1] * p.step.element_size() if isinstance(p, DecodeRow) else nbytes(p)


def part_tensor(p: Part) -> torch.Tensor:
    """The part's rows as a tensor [rows, F*H] (a view)."""
    return p.step[p.row : p.row + 1] if isinstance(p, DecodeRow) else p


def wanted_rows(parts: list[Part], off: OffDevice) -> Counter[int]:
    """Rows wanted of each host step tensor (by id) among `parts` (step tensors of >= MIN_STEP_ROWS rows)."""
    wanted: Counter[int] = Counter()
    for p in parts:
        if isinstance(p, DecodeRow) and p.step.shape[0] >= MIN_STEP_ROWS and off(p.step):
            wanted[id(p.step)] += 1
    return wanted


def runs_to_device(
    parts: list[Part],
    device: torch.device,
    moved: Moved | None = None,
    off: OffDevice | None = None,
    wanted: Counter[int] | None = None,
    min_share: float = 0.5,
) -> list[torch.Tensor]:
    """`parts` in order, as tensors on `device`. A catch-up of a plain stretch holds, per request, one row of
    each of many step tensors. Where at least `min_share` of a step tensor's rows are wanted (`wanted`, by
    default counted over `parts`; 1.0 where the moved rows stay pending, so no unwanted row is kept alive on
    the device), the whole tensor goes over once (a DMA from pinned memory, cached in `moved` across the
    calls of one flush) and its rows are sliced on the device. Gathering them on the host first is a memcpy
    of every row (at c32 after a 128-step plain stretch: 105 MB, 95 ms on a 2-core CPU) before a pageable
    copy. Other runs of consecutive host rows are concatenated and moved as one tensor; rows already on the
    device stay. `off(tensor)`: whether it is off the device (tests mark CPU tensors so)."""
    moved = {} if moved is None else moved
    is_off = off or (lambda t: t.device != device)
    wanted = wanted_rows(parts, is_off) if wanted is None else wanted
    out: list[torch.Tensor] = []
    run: list[torch.Tensor] = []

    def move_run() -> None:
        if run:
            out.append((run[0] if len(run) == 1 else torch.cat(run)).to(device))
            run.clear()

    for p in parts:
        t = p.step if isinstance(p, DecodeRow) else p
        if not is_off(t):
            move_run()
            out.append(part_tensor(p))
            continue
        whole = isinstance(p, DecodeRow) and (
            id(t) in moved or (t.shape[0] >= MIN_STEP_ROWS and wanted[id(t)] >= min_share * t.shape[0])
        )
        if not whole:
            run.append(part_tensor(p))
            continue
        move_run()
        if id(t) not in moved:
            moved[id(t)] = t.to(device, non_blocking=True)  # pinned: asynchronous, stream-ordered
        out.append(part_tensor(DecodeRow(moved[id(t)], p.row)))  # type: ignore[union-attr]
    move_run()
    return out


def on_device(
    parts: list[Part], device: torch.device, moved: Moved | None = None, off: OffDevice | None = None
) -> torch.Tensor:
    """The rows of `parts`, in order, as one tensor on `device`."""
    out = runs_to_device(parts, device, moved, off)
    return out[0] if len(out) == 1 else torch.cat(out)
