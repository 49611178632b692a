"""Bench rows: aggregation over repeats (median, with the tok/s spread) and the stderr table."""

from __future__ import annotations

import statistics
import sys
from typing import Any

KEY = ("mode", "acceptance", "concurrency")
COLUMNS = [
    ("mode", "mode"),
    ("acceptance", "acceptance"),
    ("c", "concurrency"),
    ("tok/s", "tok_per_s"),
    ("min-max", "tok_per_s_spread"),
    ("req tok/s", "per_request_tok_per_s"),
    ("tau", "tau"),
    ("draft ms", "draft_ms_per_step"),
    ("verify ms", "verify_ms_per_step"),
    ("decode ms", "decode_ms_per_step"),
    ("host ms", "host_ms_per_step"),
    ("prefill ms", "prefill_ms"),
    ("x floor", "x_plain_floor"),
    ("x own ideal", "x_own_ideal"),
    ("x plain paired (IQR)", "paired_x_plain"),
]


def throughput_fields(tokens: int, secs: float, concurrency: int, floor: float) -> dict[str, Any]:
    """The throughput columns every row shares (engine and peer): tok/s, per request, and against the floor."""
    tps = tokens / secs
    return {
        "concurrency": concurrency,
        "tokens": tokens,
        "seconds": round(secs, 4),
        "tok_per_s": round(tps, 2),
        "per_request_tok_per_s": round(tps / concurrency, 2),
        "memory_bound_floor_tok_per_s": round(floor, 1),
        "x_plain_floor": round(tps / floor, 4),
        "fraction_of_floor_per_request": round(tps / concurrency / floor, 4),
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from its repeats: numeric fields are medians, tok/s also gets min / max; the rest (histograms,
    the adaptive policy's cumulative summary) from the last run."""
    row = dict(runs[-1])
    keys = dict.fromkeys(k for r in runs for k in r)  # a field some runs lack (decode ms: no decode plan) too
    for k in keys:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if vals and k != "concurrency":
            row[k] = round(statistics.median(vals), 4)
    tps = [r["tok_per_s"] for r in runs]
    row.update(repeats=len(runs), tok_per_s_min=round(min(tps), 2), tok_per_s_max=round(max(tps), 2))
    paired = [r["paired_x_plain"] for r in runs if "paired_x_plain" in r]  # (bench --paired)
    if paired:
        q = statistics.quantiles(paired, n=4, method="inclusive") if len(paired) > 1 else [paired[0]] * 3
        row["paired_x_plain_iqr"] = [round(q[0], 4), round(q[2], 4)]
    return row


def _cell(row: dict[str, Any], key: str) -> str:
    if key == "paired_x_plain" and "paired_x_plain_iqr" in row:
        lo, hi = row["paired_x_plain_iqr"]
        return f"{row[key]:.3f} ({lo:.3f}-{hi:.3f})"
    if key == "tok_per_s_spread":
        return f"{row['tok_per_s_min']:.1f}-{row['tok_per_s_max']:.1f}" if "tok_per_s_min" in row else ""
    v = row.get(key)
    if v is None:
        return ""
    return (
        f"{v:.3g}"
        if isinstance(v, float) and key.startswith("x_")
        else (f"{v:.2f}" if isinstance(v, float) else str(v))
    )


def table(rows: list[dict[str, Any]]) -> str:
    cells = [[h for h, _ in COLUMNS]] + [[_cell(r, k) for _, k in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]], header: str) -> None:
    print(f"\n{header}\n{table(rows)}", file=sys.stderr)
