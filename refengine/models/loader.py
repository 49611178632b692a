"""Checkpoint loading: config.json plus one or many safetensors files (HF sharded index included)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from refengine.errors import CheckpointError


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, via the sharded index when there is one."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a checkpoint directory")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({d / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard files that are missing: {missing}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files")
    return files


class TensorSource:
    """Name -> tensor over all files of a checkpoint, with shape-checked typed lookup."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._where: dict[str, Path] = {}
        for f in checkpoint_files(path):
            with safe_open(str(f), framework="pt") as fh:
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
        with safe_open(str(f), framework="pt") as fh:
            t = fh.get_tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{f}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t.to(device=device, dtype=dtype)

    def check_no_extra(self, expected: set[str], ignore_prefixes: tuple[str, ...] = ()) -> None:
        extra = sorted(n for n in self.names() - expected if not n.startswith(ignore_prefixes))
        if extra:
            raise CheckpointError(f"{self.path}: unexpected tensors {extra[:8]}"
                                  f"{' ...' if len(extra) > 8 else ''} (misnamed? expected HF names)")


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
