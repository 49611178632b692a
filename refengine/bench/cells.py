"""The cell matrix of `refengine bench --sample-cells N`: every (pair and workload, concurrency, arrivals,
settle) cell, and a seeded random sample of it in random order.

Pairs and their workloads:
- `qwen3-4b`: Qwen3-4B shapes with synthetic weights (fixtures/configs/qwen3-4b and its DFlash b16 drafter,
  fixtures/configs/qwen3-4b-dflash-b16) on random prompts; synthetic drafts accept nothing, so each cell's
  acceptance is drawn from a benchmark-only profile (spec_decode/acceptance_profile.py): tau1.0, tau1.3,
  tau3, tau6.5, sharegpt.
- `tiny`: the trained tiny pair (fixtures/tiny-trained) with its real drafter, on its bundled code, prose,
  chat or mixed prompts (prompts.py).
Each workload runs at every concurrency of CONCURRENCIES, with wave and steady arrivals (job.py), settled 0 or
15 s (SETTLES_S: seconds the adaptive engine runs the cell's workload before the cell is measured). That is
5 x 5 x 2 x 2 = 100 cells for qwen3-4b and 4 x 5 x 2 x 2 = 80 for tiny, 180 in all.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from refengine.bench.job import ARRIVALS
from refengine.bench.run import BenchError
from refengine.defaults import FIXTURES, TRAINED_PAIR

PAIRS = ("qwen3-4b", "tiny")
WORKLOADS: dict[str, tuple[str, ...]] = {
    "qwen3-4b": ("tau1.0", "tau1.3", "tau3", "tau6.5", "sharegpt"),  # acceptance profiles
    "tiny": ("code", "prose", "chat", "mixed"),  # bundled prompt sets
}
CONCURRENCIES = (1, 8, 16, 32, 64)
SETTLES_S = (0.0, 15.0)


@dataclass(frozen=True)
class PairSpec:
    """Where a pair's checkpoints are, and whether its weights are synthetic (drawn from config.json alone)."""

    target: str
    draft: str
    synthetic: bool


PAIR_SPECS = {
    "qwen3-4b": PairSpec(
        str(FIXTURES / "configs" / "qwen3-4b"), str(FIXTURES / "configs" / "qwen3-4b-dflash-b16"), synthetic=True
    ),
    "tiny": PairSpec(str(TRAINED_PAIR / "target"), str(TRAINED_PAIR / "draft"), synthetic=False),
}


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: a pair and its workload (an acceptance profile for qwen3-4b, a prompt set for
    tiny), a concurrency, how requests arrive (wave / steady) and the adaptive engine's settle seconds."""

    pair: str
    workload: str
    concurrency: int
    arrivals: str
    settle_s: float

    def __post_init__(self) -> None:
        if self.pair not in PAIRS:
            raise BenchError(f"cell pair {self.pair!r}: use one of {', '.join(PAIRS)}")
        if self.workload not in WORKLOADS[self.pair]:
            raise BenchError(
                f"cell workload {self.workload!r} for pair {self.pair}: use one of {', '.join(WORKLOADS[self.pair])}"
            )
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise BenchError(f"cell concurrency {self.concurrency!r}: a positive integer")
        if self.arrivals not in ARRIVALS:
            raise BenchError(f"cell arrivals {self.arrivals!r}: use one of {', '.join(ARRIVALS)}")
        if not isinstance(self.settle_s, (int, float)) or self.settle_s < 0:
            raise BenchError(f"cell settle {self.settle_s!r}: seconds, 0 or more")

    @property
    def label(self) -> str:
        """e.g. `qwen3-4b/tau3 c16 steady settle15`."""
        return f"{self.pair}/{self.workload} c{self.concurrency} {self.arrivals} settle{self.settle_s:g}"

    @property
    def profile(self) -> str | None:
        """The acceptance profile the speculating engines draw from (None: the drafter's own acceptance)."""
        return self.workload if self.pair == "qwen3-4b" else None

    @property
    def prompts(self) -> str:
        """The prompt set (prompts.PROMPT_SETS)."""
        return "random" if self.pair == "qwen3-4b" else self.workload


def parse_pairs(text: str) -> tuple[str, ...]:
    """`--pairs`: a comma-separated subset of PAIRS, in PAIRS' order."""
    want = {p.strip() for p in text.split(",") if p.strip()}
    if not want or not want <= set(PAIRS):
        raise BenchError(f"--pairs {text!r}: give a comma-separated subset of {','.join(PAIRS)}")
    return tuple(p for p in PAIRS if p in want)


def matrix(pairs: tuple[str, ...] = PAIRS) -> list[Cell]:
    """Every cell of the pairs' matrix, in a fixed order (pair, workload, concurrency, arrivals, settle)."""
    return [
        Cell(pair, workload, c, arrivals, settle)
        for pair in pairs
        for workload in WORKLOADS[pair]
        for c in CONCURRENCIES
        for arrivals in ARRIVALS
        for settle in SETTLES_S
    ]


def sample_cells(n: int, seed: int, pairs: tuple[str, ...] = PAIRS) -> list[Cell]:
    """n distinct cells of the pairs' matrix in random order, the same for the same seed (and pairs)."""
    cells = matrix(pairs)
    if not 1 <= n <= len(cells):
        raise BenchError(
            f"--sample-cells {n}: the matrix of {','.join(pairs)} has {len(cells)} cells; give 1 to {len(cells)}"
        )
    return random.Random(seed).sample(cells, n)
