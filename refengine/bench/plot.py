"""`refengine bench --plot FILE`: tok/s against concurrency, one line per (mode, acceptance). matplotlib is
the optional extra `plot` (pip install 'refengine[plot]'), imported only here."""

from __future__ import annotations

from typing import Any

from refengine.errors import UnsupportedConfigError


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UnsupportedConfigError("--plot needs matplotlib: pip install 'refengine[plot]'") from e
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        label = r["mode"] if r["acceptance"] in ("-", "n/a") else f"{r['mode']} ({r['acceptance']})"
        lines.setdefault(label, []).append((r["concurrency"], r["tok_per_s"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=label)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tok/s")
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
