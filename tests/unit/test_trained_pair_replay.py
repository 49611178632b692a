"""The trained tiny pair's bench replayed on the CPU (tests/unit/trained_pair_replay.py): its real acceptance
tables, the H200's measured step costs of this pair, the paired bench's order. Checks that the tables still
describe the pair and the bench prompts, that the replay reproduces what the H200 measured (fixed full spans
lose to plain in waves at c8-c32, adaptive holds plain there after the settle, and speculates at c1), and
the wave guard's effect on the cells after a c1 one is tests/unit/test_wave_guard.py's.

Run: python -m pytest tests/unit/test_trained_pair_replay.py -q
"""

from __future__ import annotations

import json

import pytest

from refengine.defaults import TRAINED_PAIR
from tests.unit.trained_pair_replay import TABLES, bench_prompts, median, pair_fingerprint, replay_bench

pytestmark = pytest.mark.skipif(
    not (TRAINED_PAIR / "target" / "config.json").is_file(), reason="the trained tiny pair is not present"
)


def _cell(rows: list[tuple[float, float]]) -> str:
    return ", ".join(f"{a:.3f}" for a, _ in rows)


def test_tables_describe_the_pair_and_the_bench_prompts():
    body = json.loads(TABLES.read_text())
    target, draft = TRAINED_PAIR / "target", TRAINED_PAIR / "draft"
    now = pair_fingerprint(target, draft, bench_prompts(target))
    assert body["fingerprint"] == now, (
        f"stale acceptance tables {body['fingerprint']} against {now}: python -m tests.unit.trained_pair_replay --write"
    )
    tables = body["tables"]
    assert len(tables) == 32 and all(len(t) == 127 and all(0 <= a <= 15 for a in t) for t in tables)
    means = sorted(sum(t) / len(t) for t in tables)
    # the pair's heterogeneity, the replay's point: some prompts accept nearly every draft, some nearly none
    assert means[0] < 2.0 and means[-1] > 10.0, f"per-prompt mean accepted drafts {[round(m, 1) for m in means]}"


def test_replay_reproduces_the_h200_cells_after_the_settle():
    # H200 run 153 (c8 / c16 / c32 after the settle): adaptive 0.994 / 0.988 / 0.998 of plain, every cell
    # dormant; fixed DFlash 0.76-0.87 at c8 in runs 101-103
    got = replay_bench([8, 16, 32])
    for c, rows in got.items():
        adaptive, fixed = median([r[0] for r in rows]), median([r[1] for r in rows])
        assert adaptive >= 0.99, f"c{c}: adaptive {adaptive:.3f} of plain (rounds {_cell(rows)})"
        assert fixed < 0.9, f"c{c}: fixed full spans {fixed:.3f} of plain: the replay's waves no longer favour plain"


def test_replay_speculates_at_c1():
    # H200 runs 154 and 157: the c1 cell 2.50 / 2.80 of plain (the first prompt's generation falls into a loop
    # its drafter accepts whole)
    rows = replay_bench([1])[1]
    adaptive, fixed = median([r[0] for r in rows]), median([r[1] for r in rows])
    assert adaptive >= 0.95 * fixed and adaptive > 2.5, f"c1: adaptive {adaptive:.3f}, fixed {fixed:.3f} of plain"
