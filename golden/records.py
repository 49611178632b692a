"""The plain records every engine emits and the gates consume, and their JSONL form.

These two records are the whole interface between an engine and the golden suite: any engine (ours, a
port, a different runtime entirely) that can write them can be gated. Nothing here knows about torch.

JSONL schema (one JSON object per line; a file holds one kind of record; `.gz` files are gzip-compressed):

    TopKRecord   {"name": str, "token_ids": [int, ...n],
                  "topk_ids": [[int, ...k], ...n], "topk_logprobs": [[float, ...k], ...n]}
    GreedyRecord {"name": str, "prompt_ids": [int, ...], "output_ids": [int, ...]}

TopKRecord row p is the top-k of the next-token distribution after `token_ids[:p+1]` (teacher forcing):
one row per position, the last row predicting the token after the whole sequence. Within a row, entries
are sorted by logprob, highest first; logprobs are natural-log probabilities over the full vocabulary
(log_softmax of the logits, computed in fp32). GreedyRecord's `output_ids` are the generated tokens only
(no prompt); when generation stopped at EOS, the EOS token is the last output id.
"""
from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

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
            raise ValueError(f"{self.name}: {n} tokens but {len(self.topk_ids)} topk_ids rows and "
                             f"{len(self.topk_logprobs)} topk_logprobs rows (want one row per position)")
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
        return {"name": self.name, "token_ids": list(self.token_ids), "topk_ids": self.topk_ids,
                "topk_logprobs": [[round(float(v), LOGPROB_DECIMALS) for v in row]
                                  for row in self.topk_logprobs]}

    @classmethod
    def from_json(cls, obj: dict) -> TopKRecord:
        return cls(name=str(obj["name"]), token_ids=[int(t) for t in obj["token_ids"]],
                   topk_ids=[[int(t) for t in row] for row in obj["topk_ids"]],
                   topk_logprobs=[[float(v) for v in row] for row in obj["topk_logprobs"]])


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
        return cls(name=str(obj["name"]), prompt_ids=[int(t) for t in obj["prompt_ids"]],
                   output_ids=[int(t) for t in obj["output_ids"]])


Record = TopKRecord | GreedyRecord


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
    with _open_text(path, "r") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, json.loads(line)


def read_records(path: str | Path) -> list[Record]:
    """Read a JSONL file of TopKRecord or GreedyRecord lines (the kind is told by the keys)."""
    path = Path(path)
    out: list[Record] = []
    for lineno, obj in _iter_json(path):
        if "topk_ids" in obj:
            out.append(TopKRecord.from_json(obj))
        elif "output_ids" in obj:
            out.append(GreedyRecord.from_json(obj))
        else:
            raise ValueError(f"{path}:{lineno}: neither a TopKRecord nor a GreedyRecord: keys {sorted(obj)}")
    return out


def _read_kind(path: str | Path, kind: type) -> list:
    """Every record of a file that must hold only `kind` records."""
    recs = read_records(path)
    bad = [r.name for r in recs if not isinstance(r, kind)]
    if bad:
        raise ValueError(f"{path}: expected {kind.__name__} lines, found other records: {bad[:5]}")
    return recs


def read_topk_jsonl(path: str | Path) -> list[TopKRecord]:
    return _read_kind(path, TopKRecord)


def read_greedy_jsonl(path: str | Path) -> list[GreedyRecord]:
    return _read_kind(path, GreedyRecord)
