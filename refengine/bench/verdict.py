"""The cell matrix's verdicts (`refengine bench --sample-cells`): each cell's adaptive tok/s against the better
of plain and fixed DFlash measured in the same run, the worst cell, whether the bar holds, and the table.

A cell's measurement is a list of rounds, each the tok/s of every engine that ran in it (matrix.py):
- unpaired (plain and dflash more than PAIR_WITHIN apart, so which is better is clear): ratio = median
  adaptive / max(median plain, median dflash), medians over the rounds;
- paired (within PAIR_WITHIN of each other, where which is better is a close call): the median over the
  rounds of adaptive / max(plain, dflash) in the same round, with its interquartile range; the control (a
  second plain engine, in the rounds that ran it) / plain in the same round is the method's resolution.
A cell passes when its ratio is at least the bar.
"""

from __future__ import annotations

import statistics
from typing import Any

PAIR_WITHIN = 0.10  # plain and dflash within 10% of each other: the cell is measured paired, with a control
DEFAULT_BAR = 0.95


def within(a: float, b: float, tolerance: float = PAIR_WITHIN) -> bool:
    """The larger of a and b is at most (1 + tolerance) x the smaller."""
    lo, hi = sorted((a, b))
    return hi <= (1.0 + tolerance) * lo


def _median(rounds: list[dict[str, float]], name: str) -> float:
    return statistics.median(r[name] for r in rounds if name in r)


def _iqr(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return [round(q[0], 4), round(q[2], 4)]


def needs_pairing(rounds: list[dict[str, float]], tolerance: float = PAIR_WITHIN) -> bool:
    """Whether plain's and dflash's median tok/s over `rounds` are within `tolerance` of each other."""
    return within(_median(rounds, "plain"), _median(rounds, "dflash"), tolerance)


def judge(rounds: list[dict[str, float]], bar: float = DEFAULT_BAR) -> dict[str, Any]:
    """A cell's verdict from its rounds (each: engine name -> tok/s; plain, dflash and adaptive in every round,
    `control` in the paired ones). Paired when any round ran the control (see the module docstring)."""
    for i, r in enumerate(rounds):
        missing = {"plain", "dflash", "adaptive"} - set(r)
        if missing:
            raise ValueError(f"round {i} lacks {sorted(missing)}: {r}")
    if not rounds:
        raise ValueError("a cell's verdict needs at least one round")
    plain, dflash, adaptive = (_median(rounds, n) for n in ("plain", "dflash", "adaptive"))
    paired = any("control" in r for r in rounds)
    out: dict[str, Any] = {
        "plain_tok_per_s": round(plain, 2),
        "dflash_tok_per_s": round(dflash, 2),
        "adaptive_tok_per_s": round(adaptive, 2),
        "better": "plain" if plain >= dflash else "dflash",
        "paired": paired,
        "rounds": len(rounds),
    }
    if paired:
        ratios = [r["adaptive"] / max(r["plain"], r["dflash"]) for r in rounds]
        controls = [r["control"] / r["plain"] for r in rounds if "control" in r]
        out.update(
            ratio=round(statistics.median(ratios), 4),
            ratio_iqr=_iqr(ratios),
            control_x_plain=round(statistics.median(controls), 4),
            control_iqr=_iqr(controls),
        )
    else:
        out["ratio"] = round(adaptive / max(plain, dflash), 4)
    out["passes"] = out["ratio"] >= bar
    return out


def summarize(cells: list[dict[str, Any]], bar: float = DEFAULT_BAR) -> dict[str, Any]:
    """The sample's verdict: the worst cell (least ratio; the first of equals), whether every cell holds the bar,
    and the labels of those that do not."""
    if not cells:
        raise ValueError("no cells to summarize")
    worst = min(cells, key=lambda c: c["ratio"])
    return {
        "bar": bar,
        "worst": {k: v for k, v in worst.items() if k != "rows"},
        "bar_holds": all(c["ratio"] >= bar for c in cells),
        "failing": [c["label"] for c in cells if c["ratio"] < bar],
    }


COLUMNS = ("#", "cell", "plain tok/s", "dflash tok/s", "adaptive tok/s", "x better (IQR)", "paired", "control (IQR)")


def _span(value: float, iqr: list[float] | None) -> str:
    return f"{value:.3f}" + (f" ({iqr[0]:.3f}-{iqr[1]:.3f})" if iqr else "")


def table(cells: list[dict[str, Any]], bar: float) -> str:
    """One line per cell: tok/s of each mode, adaptive over the better, paired or not, the control's spread
    where paired, and the verdict against `bar`."""
    lines = [[*COLUMNS, f"vs {bar:g}"]]
    for c in cells:
        lines.append(
            [
                str(c["index"] + 1),
                c["label"],
                f"{c['plain_tok_per_s']:.1f}",
                f"{c['dflash_tok_per_s']:.1f}",
                f"{c['adaptive_tok_per_s']:.1f}",
                _span(c["ratio"], c.get("ratio_iqr")) + f" {c['better']}",
                "yes" if c["paired"] else "no",
                _span(c["control_x_plain"], c["control_iqr"]) if c["paired"] else "",
                "ok" if c["ratio"] >= bar else "FAIL",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = [" | ".join(x.ljust(w) for x, w in zip(line, widths)) for line in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)
