"""Checkpoint loading: config.json plus one or many safetensors files (HF sharded index included).

A file safetensors cannot read (empty, truncated, header only, not safetensors) is a CheckpointError naming the
checkpoint and the file; every loaded tensor must be floating point and finite (NaN/Inf are named by tensor).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from refengine.checkpoint_json import read_json_object
from refengine.errors import CheckpointError

FINITE_CHECK_CHUNK = 1 << 22  # elements per isfinite() pass: a 4 MiB bool transient (drafter loads after KV plan)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, via the sharded index when there is one."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a checkpoint directory")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "sharded-checkpoint index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(
                f"{index}: 'weight_map' must map tensor names to shard file names, got {str(weight_map)[:80]}"
            )
        files = sorted({d / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard files that are missing: {missing}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files")
    return files


@contextmanager
def open_safetensors(f: Path, checkpoint: Path):
    """safe_open, with any failure to read the file a CheckpointError naming the checkpoint and the file."""
    try:
        with safe_open(str(f), framework="pt") as fh:
            yield fh
    except (SafetensorError, OSError) as e:
        size = f.stat().st_size if f.is_file() else None
        what = (
            "is empty (0 bytes)"
            if size == 0
            else f"is not a readable safetensors file ({size} bytes)"
            if size is not None
            else "cannot be read"
        )
        raise CheckpointError(
            f"checkpoint {checkpoint}: weights file {f.name} {what}: {e}. "
            f"A truncated or interrupted download? Fetch {f.name} again."
        ) from e


def check_finite(t: torch.Tensor, name: str, f: Path, source: torch.Tensor) -> None:
    """NaN/Inf in loaded tensor `t` (converted from `source`) is a CheckpointError naming it. Chunked, so the
    check costs no transient bigger than 4 MiB; the counts are taken on the error path only."""
    flat = t.reshape(-1)
    if all(bool(torch.isfinite(c).all()) for c in flat.split(FINITE_CHECK_CHUNK)):
        return
    nan, inf = int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum())
    cast = ""
    if bool(torch.isfinite(source).all()):  # finite as stored: the conversion overflowed
        cast = f" after conversion from {source.dtype} to {t.dtype} (values overflow it)"
    raise CheckpointError(
        f"{f}: tensor {name!r} holds {nan} NaN and {inf} Inf values of {flat.numel()}{cast}; "
        f"refusing to load non-finite weights"
    )


class TensorSource:
    """Name -> tensor over all files of a checkpoint, with shape-, dtype- and finiteness-checked lookup."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._where: dict[str, Path] = {}
        for f in checkpoint_files(path):
            with open_safetensors(f, self.path) as fh:
                for name in fh.keys():
                    self._where[name] = f

    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing (expected shape {list(shape)})")
        with open_safetensors(f, self.path) as fh:
            t = fh.get_tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{f}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{f}: tensor {name!r} has dtype {t.dtype}, expected a floating-point weight")
        out = t.to(device=device, dtype=dtype)
        check_finite(out, name, f, t)
        return out

    def check_no_extra(self, expected: set[str], ignore_prefixes: tuple[str, ...] = ()) -> None:
        extra = sorted(n for n in self.names() - expected if not n.startswith(ignore_prefixes))
        if extra:
            raise CheckpointError(
                f"{self.path}: unexpected tensors {extra[:8]}"
                f"{' ...' if len(extra) > 8 else ''} (misnamed? expected HF names)"
            )


class SyntheticTensorSource:
    """Random weights of the right names and shapes, for benchmarks and memory tests at real model shapes
    (e.g. the shape-only Qwen3-4B config) with no checkpoint on disk. Seeded; norms are ones."""

    def __init__(self, path: str | Path, seed: int = 0, std: float = 0.02):
        self.path, self.seed, self.std = Path(path), seed, std
        self._count = 0

    def has(self, name: str) -> bool:
        return False  # so tied/untied detection follows the config alone

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self._count += 1
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        g = torch.Generator(device=device).manual_seed(self.seed * 100003 + self._count)
        return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * self.std).to(dtype)

    def check_no_extra(self, expected: set[str], ignore_prefixes: tuple[str, ...] = ()) -> None:
        return None


def tensor_source(path: str | Path, synthetic: bool):
    return SyntheticTensorSource(path) if synthetic else TensorSource(path)
