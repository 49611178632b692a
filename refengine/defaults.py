"""Where the embedded fixture pairs live (shipped inside the package tree; no network, ever)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TRAINED_PAIR = FIXTURES / "tiny-trained"
RANDOM_PAIR = FIXTURES / "tiny-random"


def default_pair() -> tuple[Path, Path]:
    """The trained tiny pair when present (it has a tokenizer and real acceptance), else the random one."""
    for pair in (TRAINED_PAIR, RANDOM_PAIR):
        if (pair / "target" / "config.json").is_file() and (pair / "draft" / "config.json").is_file():
            return pair / "target", pair / "draft"
    raise FileNotFoundError(f"no fixture pair under {FIXTURES} (run python -m fixtures.build.random_pair)")
