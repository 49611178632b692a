"""The bench's modules import each other without a cycle, counting imports inside functions (lazy ones) too:
the engine-loading helpers that suite.py, paired.py and matrix.py share live in loading.py, so paired.py no
longer imports suite.py while suite.py imports paired.py. Read from the sources' syntax trees (nothing runs).

Run: python -m pytest tests/unit/test_bench_imports.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

import refengine.bench

BENCH = Path(refengine.bench.__file__).parent
PREFIX = "refengine.bench."


def _imports(path: Path) -> set[str]:
    """The bench submodules a module imports anywhere in its source (module level or inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(PREFIX))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PREFIX):
                out.add(node.module)
            elif node.module == "refengine.bench":  # from refengine.bench import suite
                out.update(PREFIX + a.name for a in node.names if (BENCH / f"{a.name}.py").is_file())
    return {m[len(PREFIX) :] for m in out}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a path (its first module again at its end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_among_the_bench_modules():
    graph = {p.stem: _imports(p) for p in BENCH.glob("*.py") if p.stem != "__init__"}
    assert {"loading", "paired", "suite", "matrix"} <= set(graph), sorted(graph)
    assert "suite" not in graph["paired"] and "loading" in graph["paired"] and "loading" in graph["suite"], graph
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"
