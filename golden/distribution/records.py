"""The distribution gate's records and their JSONL form (one JSON object per line, `.gz` ok).

    SampleRecord      {"name": str, "prompt_ids": [int, ...], "output_ids": [int, ...n], "seed": int}
    ConditionalRecord {"name": str, "prompt_ids": [int, ...], "output_ids": [int, ...n],
                       "temperature": float, "top_k": int, "top_p": float,
                       "cdf_below": [float, ...n], "prob": [float, ...n]}

A SampleRecord is one continuation an engine SAMPLED (speculative or not) after `prompt_ids`, under the
sampling settings of the golden record of the same name, with `seed` its sampling seed (recorded, and used
to key the gate's PIT randomization; the engine's own stream is its business). A ConditionalRecord is the
oracle's answer for that continuation, teacher-forced through HF (golden/hf_sampling.py): at output position
i, with P the target's processed distribution (golden.distribution.processing) after prompt + output[:i],
`prob[i]` = P(output[i]) and `cdf_below[i]` = the mass of P over the tokens ranked before output[i] in
probability-rank order (more probable, or as probable with a lower id: processing.cdf_step). Only these two numbers per
position are stored (a full 151k-entry row per position would be needlessly large): they are all the
randomized PIT needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from golden.errors import RecordError
from golden.records import _iter_json, _open_text

PROB_DECIMALS = 12  # stored precision of cdf_below / prob: far below any PIT resolution the tests reach


@dataclass(frozen=True)
class SampleRecord:
    name: str
    prompt_ids: list[int]
    output_ids: list[int]
    seed: int

    def __post_init__(self) -> None:
        if not self.output_ids:
            raise RecordError(f"{self.name}: a sample with no output tokens")

    @property
    def ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> SampleRecord:
        return cls(
            name=str(obj["name"]),
            prompt_ids=[int(t) for t in obj["prompt_ids"]],
            output_ids=[int(t) for t in obj["output_ids"]],
            seed=int(obj["seed"]),
        )


@dataclass(frozen=True)
class ConditionalRecord:
    name: str
    prompt_ids: list[int]
    output_ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    cdf_below: list[float]  # [n] mass ranked before each sampled token (processing.cdf_step)
    prob: list[float]  # [n] p(x) of each sampled token

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if not n or len(self.cdf_below) != n or len(self.prob) != n:
            raise RecordError(
                f"{self.name}: {n} output tokens but {len(self.cdf_below)} cdf_below and {len(self.prob)} prob "
                f"(want one of each per output token, at least one)"
            )
        for i, (c, p) in enumerate(zip(self.cdf_below, self.prob)):
            if not (0.0 <= c <= 1.0 + 1e-9 and 0.0 <= p <= 1.0 + 1e-9 and c + p <= 1.0 + 1e-9):
                raise RecordError(f"{self.name} position {i}: cdf_below {c} and prob {p} are not a CDF step")

    @property
    def ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    def to_json(self) -> dict:
        obj = asdict(self)
        obj["cdf_below"] = [round(float(v), PROB_DECIMALS) for v in self.cdf_below]
        obj["prob"] = [round(float(v), PROB_DECIMALS) for v in self.prob]
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> ConditionalRecord:
        return cls(
            name=str(obj["name"]),
            prompt_ids=[int(t) for t in obj["prompt_ids"]],
            output_ids=[int(t) for t in obj["output_ids"]],
            temperature=float(obj["temperature"]),
            top_k=int(obj["top_k"]),
            top_p=float(obj["top_p"]),
            cdf_below=[float(v) for v in obj["cdf_below"]],
            prob=[float(v) for v in obj["prob"]],
        )


def write_distribution_jsonl(path: str | Path, records: Iterable[SampleRecord | ConditionalRecord]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open_text(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec.to_json(), separators=(",", ":")) + "\n")
    return path


def _read(path: str | Path, kind: type[SampleRecord] | type[ConditionalRecord]) -> list:
    path = Path(path)
    out = []
    for lineno, obj in _iter_json(path):
        try:
            out.append(kind.from_json(obj))
        except RecordError as e:
            raise RecordError(f"{path}:{lineno}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise RecordError(f"{path}:{lineno}: bad {kind.__name__}: {type(e).__name__} {e}") from None
    return out


def read_samples_jsonl(path: str | Path) -> list[SampleRecord]:
    return _read(path, SampleRecord)


def read_conditionals_jsonl(path: str | Path) -> list[ConditionalRecord]:
    return _read(path, ConditionalRecord)
