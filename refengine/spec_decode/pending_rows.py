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

from collections import Counter
from collections.abc import Callable

import torch

HOST_PENDING_BYTES = 1 << 30  # per lane: ~42k rows of Qwen3-4B features (5 taps x 2560 x bf16)
MIN_STEP_ROWS = 8  # a step tensor of fewer rows is concatenated on the host: its bytes are few, copies many


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


Moved = dict[int, torch.Tensor]  # id of a host step tensor -> its copy on the device (one flush's cache)
OffDevice = Callable[[torch.Tensor], bool]


def _whole_step(part: torch.Tensor) -> torch.Tensor | None:
    """The step tensor [rows, F*H] a host part is a row view of (the runner's pinned copy of one decode
    step's features, split per request), or None."""
    base = part._base
    if base is None or base.dim() != 2 or part.dim() != 2 or not base.is_contiguous():
        return None
    if base.shape[0] < MIN_STEP_ROWS:
        return None
    return base if base.shape[1] == part.shape[1] else None


def wanted_rows(parts: list[torch.Tensor], off: OffDevice) -> Counter[int]:
    """Rows wanted of each host step tensor (by id) among `parts`."""
    return _count(parts, [_whole_step(f) if off(f) else None for f in parts])


def _count(parts: list[torch.Tensor], bases: list[torch.Tensor | None]) -> Counter[int]:
    wanted: Counter[int] = Counter()
    for f, base in zip(parts, bases):
        if base is not None:
            wanted[id(base)] += f.shape[0]
    return wanted


def runs_to_device(
    parts: list[torch.Tensor],
    device: torch.device,
    moved: Moved | None = None,
    off: OffDevice | None = None,
    wanted: Counter[int] | None = None,
    min_share: float = 0.5,
) -> list[torch.Tensor]:
    """`parts` in order, moved to `device`. A decode step's features arrive as one pinned tensor split per
    request, so a catch-up of a plain stretch holds, per request, one row of each of many step tensors.
    Where at least `min_share` of a step tensor's rows are wanted (`wanted`, by default counted over `parts`;
    1.0 where the moved rows stay pending, so no unwanted row is kept alive on the device),
    the whole tensor goes over once (a DMA from pinned memory, cached in `moved` across the calls of one
    flush) and its rows are sliced on the device. Concatenating them on the host first is a memcpy of every
    row (at c32 after a 128-step plain stretch: 105 MB, 95 ms on a 2-core CPU) before a pageable copy.
    Other runs of consecutive host parts are concatenated and moved as one tensor; parts already on the
    device stay. `off(part)`: whether a part is off the device (tests mark CPU rows so)."""
    moved = {} if moved is None else moved
    is_off = off or (lambda t: t.device != device)
    held = [is_off(f) for f in parts]
    bases = [_whole_step(f) if h else None for f, h in zip(parts, held)]
    wanted = _count(parts, bases) if wanted is None else wanted
    out: list[torch.Tensor] = []
    run: list[torch.Tensor] = []

    def move_run() -> None:
        if run:
            out.append((run[0] if len(run) == 1 else torch.cat(run)).to(device))
            run.clear()

    for f, h, base in zip(parts, held, bases):
        if not h:
            move_run()
            out.append(f)
            continue
        if base is None or (id(base) not in moved and wanted[id(base)] < min_share * base.shape[0]):
            run.append(f)
            continue
        move_run()
        if id(base) not in moved:
            moved[id(base)] = base.to(device, non_blocking=True)  # pinned: asynchronous, stream-ordered
        row = (f.storage_offset() - base.storage_offset()) // base.stride(0)
        out.append(moved[id(base)][row : row + f.shape[0]])
    move_run()
    return out


def on_device(
    parts: list[torch.Tensor], device: torch.device, moved: Moved | None = None, off: OffDevice | None = None
) -> torch.Tensor:
    """The rows of `parts`, in order, as one tensor on `device`."""
    out = runs_to_device(parts, device, moved, off)
    return out[0] if len(out) == 1 else torch.cat(out)
