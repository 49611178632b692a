"""Coverage: which engine record is gated against which golden record, and the errors when they do not match.

Every gate matches records by name. A gate that silently skips what the engine did not write would PASS an
empty file, so matching is strict: the engine must write exactly one record per golden record (or, when the
caller names an explicit subset, exactly one per named record), with the same input ids. Anything else
raises CoverageError with the names and the numbers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from golden.errors import CoverageError


class Named(Protocol):
    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)
G = TypeVar("G", bound=Named)
SHOW = 8  # names listed in a message before "... and N more"


@dataclass(frozen=True)
class Coverage:
    gated: int  # records gated
    golden_total: int  # records in the golden set
    subset: bool  # the caller named an explicit subset

    def __str__(self) -> str:
        what = "explicit subset" if self.subset else "full coverage"
        return f"{self.gated} of {self.golden_total} golden records ({what})"


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:SHOW])
    return shown + (f" ... and {len(names) - SHOW} more" if len(names) > SHOW else "")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing element, the shorter length when one is a prefix, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _duplicates(names: Sequence[str]) -> list[str]:
    return sorted(n for n, c in Counter(names).items() if c > 1)


def match_records(
    engine: Sequence[E],
    golden: Sequence[G],
    *,
    what: str,
    ids: Callable[[Any], Sequence[int]],
    ids_label: str,
    names: Sequence[str] | None = None,
) -> tuple[list[tuple[E, G]], Coverage]:
    """Pairs (engine record, golden record) in golden order, and the coverage.

    what: the golden side's label in messages ("HF", "greedy golden", ...); ids(record): the input ids the
    two sides must share (token_ids, prompt_ids); names: gate only this explicit subset of the golden.
    Raises CoverageError for: no engine records; a name twice on either side; an engine name the golden
    does not know (or outside `names`); a golden (or named) record with no engine record; different ids."""
    golden_dups, engine_dups = _duplicates([g.name for g in golden]), _duplicates([e.name for e in engine])
    if golden_dups:
        raise CoverageError(f"the {what} records hold these names more than once: {_names(golden_dups)}")
    if not engine:
        raise CoverageError(
            f"no engine records: nothing was gated against the {len(golden)} {what} records "
            f"(first: {_names([g.name for g in golden])})"
        )
    if engine_dups:
        raise CoverageError(
            f"engine records hold these names more than once: {_names(engine_dups)} (one record per name)"
        )
    by_name = {g.name: g for g in golden}
    if names is not None:
        unknown_names = [n for n in names if n not in by_name]
        if unknown_names:
            raise CoverageError(f"subset names not in the {what} records: {_names(unknown_names)}")
        if _duplicates(list(names)):
            raise CoverageError(f"subset names given more than once: {_names(_duplicates(list(names)))}")
    wanted = list(by_name) if names is None else list(names)
    wanted_set = set(wanted)
    unknown = [e.name for e in engine if e.name not in by_name]
    if unknown:
        raise CoverageError(
            f"engine records with no {what} record: {_names(unknown)} ({what} has {_names(sorted(by_name))})"
        )
    outside = [e.name for e in engine if e.name not in wanted_set]
    if outside:
        raise CoverageError(f"engine records outside the named subset of {len(wanted)}: {_names(outside)}")
    have = {e.name: e for e in engine}
    missing = [n for n in wanted if n not in have]
    if missing:
        scope = "named subset" if names is not None else f"{what} records"
        raise CoverageError(
            f"partial coverage: engine wrote {len(have)} of the {len(wanted)} {scope}; "
            f"missing {len(missing)}: {_names(missing)}"
        )
    pairs = []
    for n in wanted:
        e, g = have[n], by_name[n]
        d = first_difference(list(ids(e)), list(ids(g)))
        if d is not None:
            raise CoverageError(
                f"{n}: engine and {what} records hold different {ids_label} (first difference "
                f"at {d}, lengths {len(ids(e))} vs {len(ids(g))}): the engine was not run on "
                f"the golden inputs"
            )
        pairs.append((e, g))
    return pairs, Coverage(gated=len(pairs), golden_total=len(golden), subset=names is not None)
