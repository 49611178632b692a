"""Bench prompt sets: random token ids, or the trained tiny pair's held-out code / prose / chat prompts
(fixtures/tiny-trained/eval_prompts.jsonl, token ids of that pair's tokenizer)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from refengine.defaults import TRAINED_PAIR
from refengine.errors import UnsupportedConfigError

PROMPT_SETS = ("random", "code", "prose", "chat", "mixed")
EVAL_PROMPTS = TRAINED_PAIR / "eval_prompts.jsonl"


def _bundled() -> dict[str, list[list[int]]]:
    if not EVAL_PROMPTS.is_file():
        raise UnsupportedConfigError(f"no bundled prompts at {EVAL_PROMPTS}: use --prompts random")
    out: dict[str, list[list[int]]] = {}
    for line in EVAL_PROMPTS.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.setdefault(rec["category"], []).append(rec["prompt_ids"])
    return out


def make_prompts(
    kind: str, n: int, prompt_len: int, vocab_size: int, target: str | Path, seed: int = 0
) -> list[list[int]]:
    """n prompts of the set `kind`. Random prompts have exactly prompt_len tokens; bundled ones keep their
    last prompt_len tokens (where generation continues) and cycle when n exceeds the set."""
    if kind not in PROMPT_SETS:
        raise UnsupportedConfigError(f"--prompts {kind!r}: use one of {PROMPT_SETS}")
    if kind == "random":
        rng = random.Random(seed + n)
        return [[rng.randrange(vocab_size - 1) for _ in range(prompt_len)] for _ in range(n)]
    if not (Path(target) / "tokenizer.json").is_file():
        raise UnsupportedConfigError(
            f"--prompts {kind}: the bundled prompts are token ids of the trained tiny "
            f"pair's tokenizer, and {target} has no tokenizer.json: use --prompts random"
        )
    sets = _bundled()
    if kind == "mixed":
        cats = sorted(sets)
        pool = [sets[c][i] for i in range(max(len(v) for v in sets.values())) for c in cats if i < len(sets[c])]
    else:
        pool = sets[kind]
    prompts = [pool[i % len(pool)][-prompt_len:] for i in range(n)]
    if max(max(p) for p in prompts) >= vocab_size:
        raise UnsupportedConfigError(f"--prompts {kind}: bundled ids exceed this target's vocab ({vocab_size})")
    return prompts
