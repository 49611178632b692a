"""What the bench's floors are computed from: the device's copy bandwidth and the weight bytes a step streams
(run.py's x_plain_floor and x_own_ideal)."""

from __future__ import annotations

import time
from typing import Any

import torch


def measure_copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (CPU: memcpy of a 256 MiB buffer)."""
    n = 1 << 28
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync_device(device)
    return 2 * n * 10 / (time.perf_counter() - t0)


def sync_device(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for elsewhere."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct tensors reachable from objs (attributes, lists, dicts; shared tensors once)."""
    seen: set[int] = set()
    total = 0
    stack = list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.data_ptr() not in seen:
                seen.add(o.data_ptr())
                total += o.numel() * o.element_size()
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            stack.extend(v for k, v in vars(o).items() if k not in ("rope", "cfg", "mcfg"))
    return total


def target_weight_bytes(target) -> int:
    return tensor_bytes(target.embed_tokens, target.lm_head, target.final_norm, target.layers)


def drafter_weight_bytes(drafter) -> int:
    """What one draft step streams: fc, norms, layers, and the (shared) lm_head it reads again."""
    return tensor_bytes(drafter.fc, drafter.hidden_norm, drafter.layers, drafter.norm, drafter.lm_head)
