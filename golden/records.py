"""The plain records every engine emits and the gates consume, and their JSONL form.

These records are the whole interface between an engine and the golden suite: any engine (ours, a port, a
different runtime entirely) that can write them can be gated. Nothing here knows about torch.

JSONL schema (one JSON object per line; a file holds one kind of record; `.gz` files are gzip-compressed):

    TopKRecord   {"name": str, "token_ids": [int, ...n],
                  "topk_ids": [[int, ...k], ...n], "topk_logprobs": [[float, ...k], ...n]}
    GreedyRecord {"name": str, "prompt_ids": [int, ...], "output_ids": [int, ...]}
    AcceptanceRecord {"name": str, "prompt_ids": [int, ...], "output_ids": [int, ...],
                      "accepted_lengths": [int, ...steps], "draft_margins": [[float, ...], ...steps]}

TopKRecord row p is the top-k of the next-token distribution after `token_ids[:p+1]` (teacher forcing):
one row per position, the last row predicting the token after the whole sequence. Within a row, entries
are sorted by logprob, highest first; logprobs are natural-log probabilities over the full vocabulary
(log_softmax of the logits, computed in fp32). GreedyRecord's `output_ids` are the generated tokens only
(no prompt); when generation stopped at EOS, the EOS token is the last output id.
AcceptanceRecord: a speculative greedy run; `accepted_lengths[i]` is the number of tokens verify step i
committed (accepted drafts + the bonus, cut right after an EOS), so 1 + sum(accepted_lengths) ==
len(output_ids) (the first token comes from prefill). `draft_margins` (goldens only; optional for an
engine) holds, per step, the drafter's top-1 minus top-2 logit at each drafted position of the span.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from golden.errors import RecordError

LOGPROB_DECIMALS = 6  # stored precision: far below every tolerance (the tightest, --check, is 1e-4)


@dataclass(frozen=True)
class TopKRecord:
    """Teacher-forced top-k next-token logprobs at every position of `token_ids`."""

    name: str
    token_ids: list[int]
    topk_ids: list[list[int]]  # [n][k]
    topk_logprobs: list[list[float]]  # [n][k], sorted descending

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.topk_ids) != n or len(self.topk_logprobs) != n:
            raise ValueError(
                f"{self.name}: {n} tokens but {len(self.topk_ids)} topk_ids rows and "
                f"{len(self.topk_logprobs)} topk_logprobs rows (want one row per position)"
            )
        for p, (ids, lps) in enumerate(zip(self.topk_ids, self.topk_logprobs)):
            if len(ids) != len(lps) or not ids:
                raise ValueError(f"{self.name} row {p}: {len(ids)} ids vs {len(lps)} logprobs")
            if any(a < b for a, b in zip(lps, lps[1:])):
                raise ValueError(f"{self.name} row {p}: logprobs not sorted descending: {lps[:4]}...")

    @property
    def k(self) -> int:
        """The smallest row width (rows normally all have the same k)."""
        return min((len(r) for r in self.topk_ids), default=0)

    def logprob_of(self, position: int, token: int) -> float | None:
        """Logprob of `token` in row `position`, or None when it is outside the stored top-k."""
        try:
            return self.topk_logprobs[position][self.topk_ids[position].index(token)]
        except ValueError:
            return None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "token_ids": list(self.token_ids),
            "topk_ids": self.topk_ids,
            "topk_logprobs": [[round(float(v), LOGPROB_DECIMALS) for v in row] for row in self.topk_logprobs],
        }

    @classmethod
    def from_json(cls, obj: dict) -> TopKRecord:
        return cls(
            name=str(obj["name"]),
            token_ids=[int(t) for t in obj["token_ids"]],
            topk_ids=[[int(t) for t in row] for row in obj["topk_ids"]],
            topk_logprobs=[[float(v) for v in row] for row in obj["topk_logprobs"]],
        )


@dataclass(frozen=True)
class GreedyRecord:
    """A greedy generation: the prompt and the generated tokens (EOS included when it stopped there)."""

    name: str
    prompt_ids: list[int]
    output_ids: list[int]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> GreedyRecord:
        return cls(
            name=str(obj["name"]),
            prompt_ids=[int(t) for t in obj["prompt_ids"]],
            output_ids=[int(t) for t in obj["output_ids"]],
        )


@dataclass(frozen=True)
class AcceptanceRecord:
    """A speculative greedy run: output and tokens committed per verify step (see the module docstring)."""

    name: str
    prompt_ids: list[int]
    output_ids: list[int]
    accepted_lengths: list[int]  # [steps]: tokens committed by each verify step, 1..block_size
    draft_margins: list[list[float]] = field(default_factory=list)  # [steps][span-1], or [] when not recorded

    def __post_init__(self) -> None:
        if any(a < 1 for a in self.accepted_lengths):
            raise RecordError(f"{self.name}: accepted lengths must be >= 1, got {self.accepted_lengths}")
        if 1 + sum(self.accepted_lengths) != len(self.output_ids):
            raise RecordError(
                f"{self.name}: 1 + sum(accepted_lengths) = {1 + sum(self.accepted_lengths)} but "
                f"{len(self.output_ids)} output ids (the first token comes from prefill, every "
                f"later one from a verify step)"
            )
        if self.draft_margins and len(self.draft_margins) != len(self.accepted_lengths):
            raise RecordError(
                f"{self.name}: {len(self.draft_margins)} draft_margins rows for {len(self.accepted_lengths)} steps"
            )

    @property
    def tau(self) -> float:
        """Committed tokens per verify step (0 when there was none)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    def to_json(self) -> dict:
        out = {
            "name": self.name,
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "accepted_lengths": list(self.accepted_lengths),
        }
        if self.draft_margins:
            out["draft_margins"] = [[round(float(v), LOGPROB_DECIMALS) for v in row] for row in self.draft_margins]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> AcceptanceRecord:
        return cls(
            name=str(obj["name"]),
            prompt_ids=[int(t) for t in obj["prompt_ids"]],
            output_ids=[int(t) for t in obj["output_ids"]],
            accepted_lengths=[int(a) for a in obj["accepted_lengths"]],
            draft_margins=[[float(v) for v in row] for row in obj.get("draft_margins", [])],
        )


Record = TopKRecord | GreedyRecord | AcceptanceRecord


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        # mtime=0 and no file name in the header: the same records always give the same bytes, so stored
        # goldens regenerate without a spurious diff.
        raw = open(path, mode + "b")  # closed by _ClosingText
        gz = gzip.GzipFile(filename="", mode=mode + "b", fileobj=raw, mtime=0)
        return _ClosingText(gz, raw)
    return open(path, mode, encoding="utf-8", newline="\n")


class _ClosingText(io.TextIOWrapper):
    """A text wrapper over a GzipFile that also closes the underlying file object."""

    def __init__(self, gz: gzip.GzipFile, raw: IO[bytes]) -> None:
        super().__init__(gz, encoding="utf-8", newline="\n")
        self._raw = raw

    def close(self) -> None:
        super().close()
        self._raw.close()


def write_jsonl(path: str | Path, records: Iterable[Record]) -> Path:
    """Write records one JSON object per line (gzip when the path ends in .gz); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open_text(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec.to_json(), separators=(",", ":")) + "\n")
    return path


def _iter_json(path: Path) -> Iterator[tuple[int, dict]]:
    if not path.is_file():
        raise RecordError(f"{path}: no such record file")
    try:
        with _open_text(path, "r") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise RecordError(f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno})") from None
                    if not isinstance(obj, dict):
                        raise RecordError(f"{path}:{lineno}: a record must be a JSON object, got {type(obj).__name__}")
                    yield lineno, obj
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: cannot read records: {e}") from None


def _parse(path: Path, lineno: int, obj: dict) -> Record:
    kind: type[TopKRecord] | type[GreedyRecord] | type[AcceptanceRecord]
    if "topk_ids" in obj:
        kind = TopKRecord
    elif "accepted_lengths" in obj:
        kind = AcceptanceRecord
    elif "output_ids" in obj:
        kind = GreedyRecord
    else:
        raise RecordError(f"{path}:{lineno}: not a TopKRecord, GreedyRecord or AcceptanceRecord: keys {sorted(obj)}")
    try:
        return kind.from_json(obj)
    except RecordError as e:
        raise RecordError(f"{path}:{lineno}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise RecordError(f"{path}:{lineno}: bad {kind.__name__}: {type(e).__name__} {e}") from None


def read_records(path: str | Path) -> list[Record]:
    """Read a JSONL file of records (the kind is told by the keys); RecordError names the line at fault."""
    path = Path(path)
    return [_parse(path, lineno, obj) for lineno, obj in _iter_json(path)]


def _read_kind(path: str | Path, kind: type) -> list:
    """Every record of a file that must hold only `kind` records."""
    recs = read_records(path)
    bad = [f"{r.name} ({type(r).__name__})" for r in recs if not isinstance(r, kind)]
    if bad:
        raise RecordError(f"{path}: expected {kind.__name__} lines, found other records: {bad[:5]}")
    return recs


def read_topk_jsonl(path: str | Path) -> list[TopKRecord]:
    return _read_kind(path, TopKRecord)


def read_greedy_jsonl(path: str | Path) -> list[GreedyRecord]:
    return _read_kind(path, GreedyRecord)


def read_acceptance_jsonl(path: str | Path) -> list[AcceptanceRecord]:
    return _read_kind(path, AcceptanceRecord)
