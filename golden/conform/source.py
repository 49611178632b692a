"""What a conformance run is gated against: the pair's golden prompts and records, and the HF scorer.

`--pair DIR` is either a stored golden set (golden/data/<pair>: manifest.json, topk.jsonl.gz, greedy.jsonl,
acceptance.jsonl when the pair has a trained drafter) or an HF checkpoint (config.json): then the records are
computed live with HF (golden/hf_reference.py) over the pair's prompt set (golden/pairs.py), `--prompts N`
of them. The HF model that scores divergences (the regret gates) is `--hf-model`, by default the checkpoint
itself, or fixtures/<pair>/target for a stored set.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from golden.errors import GoldenError
from golden.gates import TopKLike
from golden.records import (
    AcceptanceRecord,
    GreedyRecord,
    TopKRecord,
    read_acceptance_jsonl,
    read_greedy_jsonl,
    read_topk_jsonl,
)


@dataclass
class GoldenSource:
    pair: str
    hf_model: Path  # scores divergences (teacher-forced top-k)
    tokenizer: Path | None  # maps the server's token strings back to ids
    topk: list[TopKRecord]
    greedy: list[GreedyRecord]
    acceptance: list[AcceptanceRecord] = field(default_factory=list)
    dtype: str = "float32"  # of the HF scorer
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not (self.hf_model / "config.json").is_file():
            raise GoldenError(f"HF scorer {self.hf_model} has no config.json (give --hf-model)")
        if not self.greedy or not self.topk:
            raise GoldenError(f"pair {self.pair}: no golden prompts ({len(self.topk)} topk, {len(self.greedy)} greedy)")

    def score(self, ids: list[int]) -> TopKLike:
        """The regret gates' score_fn: score_record as the gates' protocol type."""
        return cast(TopKLike, self.score_record(ids))

    def score_record(self, ids: Sequence[int]) -> TopKRecord:
        """HF teacher-forced top-k rows of `ids`."""
        import torch

        from golden.hf_reference import teacher_forced_topk

        dtype = getattr(torch, self.dtype)
        return teacher_forced_topk(self.hf_model, {"score": ids}, dtype=dtype, device=self.device)[0]

    @property
    def golden_tau(self) -> float | None:
        steps = sum(len(r.accepted_lengths) for r in self.acceptance)
        return sum(sum(r.accepted_lengths) for r in self.acceptance) / steps if steps else None


def _tokenizer(model: Path) -> Path | None:
    path = model / "tokenizer.json"
    return path if path.is_file() else None


def load_source(
    pair_dir: Path,
    hf_model: Path | None = None,
    tokenizer: Path | None = None,
    prompts: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> GoldenSource:
    """The golden source for `--pair DIR` (see the module docstring); `prompts` keeps the first N."""
    if prompts is not None and prompts < 1:
        raise GoldenError(f"--prompts must be >= 1, got {prompts}")
    if (pair_dir / "manifest.json").is_file():
        from golden.pairs import FIXTURES

        manifest = json.loads((pair_dir / "manifest.json").read_text())
        name = manifest["pair"]
        model = hf_model or FIXTURES / name / "target"
        acc = pair_dir / "acceptance.jsonl"
        src = GoldenSource(
            pair=name,
            hf_model=model,
            tokenizer=tokenizer or _tokenizer(model),
            topk=read_topk_jsonl(pair_dir / "topk.jsonl.gz")[:prompts],
            greedy=read_greedy_jsonl(pair_dir / "greedy.jsonl")[:prompts],
            acceptance=read_acceptance_jsonl(acc)[:prompts] if acc.is_file() else [],
            dtype=dtype,
            device=device,
        )
        return src
    if (pair_dir / "config.json").is_file():
        return _live(pair_dir, hf_model or pair_dir, tokenizer, prompts, dtype, device)
    raise GoldenError(f"--pair {pair_dir}: neither a stored golden set (manifest.json) nor an HF checkpoint")


def _live(pair_dir: Path, model: Path, tokenizer: Path | None, prompts: int | None, dtype: str, device: str):
    import torch

    from golden import hf_reference
    from golden.pairs import PairSpec, prompt_set

    # the drafter's config names the MASK id random prompts avoid: a sibling draft/ (the fixtures' layout),
    # else none (then the last vocabulary row is avoided)
    draft = pair_dir.parent / "draft"
    spec = PairSpec(name=pair_dir.name, target_dir=pair_dir, draft_dir=draft if draft.is_dir() else pair_dir / "-")
    chosen = dict(list(prompt_set(spec).items())[:prompts])
    dt = getattr(torch, dtype)
    greedy = hf_reference.greedy(model, chosen, spec.continuation_tokens, spec.eos_token_id, dt, device)
    seqs = {g.name: g.prompt_ids + g.output_ids for g in greedy}
    topk = hf_reference.teacher_forced_topk(model, seqs, k=spec.k, dtype=dt, device=device)
    return GoldenSource(spec.name, model, tokenizer or _tokenizer(model), topk, greedy, [], dtype, device)
