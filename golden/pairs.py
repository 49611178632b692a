"""The fixture pairs the goldens are made for: where each pair lives, its prompt set (seeded random token
prompts of lengths around the 16-token block / page edges, plus code / prose / chat text for a pair with a
tokenizer), and the hashes of its weights (a golden set records them; a changed fixture must be regenerated).
Used by golden/regen.py and the golden tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
REQUIRED_LENGTHS = (1, 2, 15, 16, 17, 31, 32, 33, 127, 128, 255, 256)  # around the 16-token block/page edges

# Text prompts for pairs with a tokenizer (a trained pair); the chat one uses Qwen3's ChatML framing.
TEXT_PROMPTS = {
    "code-fib": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "code-sort": "# Sort a list of (name, age) pairs by age, then by name.\npeople = [",
    "code-class": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "prose-river": "The river wound slowly through the valley, and on its banks",
    "prose-history": "In the early years of the printing press, books were",
    "chat-capital": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "chat-explain": "<|im_start|>user\nExplain recursion in one paragraph.<|im_end|>\n<|im_start|>assistant\n",
}


@dataclass(frozen=True)
class PairSpec:
    """What the goldens of one model pair are generated from."""

    name: str
    target_dir: Path
    draft_dir: Path
    seed: int = 1234
    num_random: int = 48
    continuation_tokens: int = 24
    k: int = 20
    dtype: torch.dtype = torch.float32

    @property
    def target_config(self) -> dict:
        return json.loads((self.target_dir / "config.json").read_text())

    @property
    def tokenizer_path(self) -> Path | None:
        path = self.target_dir / "tokenizer.json"
        return path if path.exists() else None

    @property
    def eos_token_id(self) -> int | list[int] | None:
        """What HF generate() stops on: generation_config.json's eos_token_id when that file exists, else
        config.json's. Random-token pairs run every prompt to full length (their EOS is meaningless)."""
        if not self.tokenizer_path:
            return None
        gen = self.target_dir / "generation_config.json"
        if gen.is_file():
            return json.loads(gen.read_text()).get("eos_token_id")
        return self.target_config.get("eos_token_id")


def pair_spec(name: str, fixtures_root: Path = FIXTURES) -> PairSpec:
    root = fixtures_root / name
    if not (root / "target" / "config.json").exists():
        raise FileNotFoundError(
            f"no model pair {name!r}: {root}/target/config.json missing; pairs here: {available_pairs(fixtures_root)}"
        )
    return PairSpec(name=name, target_dir=root / "target", draft_dir=root / "draft")


def spec_from_manifest(spec: PairSpec, manifest: dict) -> PairSpec:
    """The spec the stored goldens were made with (seed, count, k, continuation), for --check."""
    return dataclasses.replace(
        spec,
        seed=manifest["seed"],
        k=manifest["k"],
        num_random=manifest["prompt_recipe"]["random"]["count"],
        continuation_tokens=manifest["continuation_tokens"],
        dtype=getattr(torch, manifest["dtype"]),
    )


def available_pairs(fixtures_root: Path = FIXTURES) -> list[str]:
    return sorted(p.parent.name for p in fixtures_root.glob("*/target/config.json"))


def _mask_token_id(spec: PairSpec, target_cfg: dict) -> int:
    """The drafter's MASK id (a prompt must never contain it), else the usual last vocabulary row."""
    draft_cfg = spec.draft_dir / "config.json"
    if draft_cfg.exists():
        return int(json.loads(draft_cfg.read_text())["dflash_config"]["mask_token_id"])
    return target_cfg["vocab_size"] - 1


def random_prompts(spec: PairSpec) -> dict[str, list[int]]:
    """REQUIRED_LENGTHS plus distinct seeded lengths in 3..254, tokens uniform over non-special ids."""
    cfg = spec.target_config
    rng = random.Random(spec.seed)
    extra = [n for n in range(3, 255) if n not in REQUIRED_LENGTHS]
    lengths = sorted(list(REQUIRED_LENGTHS) + rng.sample(extra, spec.num_random - len(REQUIRED_LENGTHS)))
    special = {0, cfg.get("bos_token_id"), _mask_token_id(spec, cfg)}
    eos = cfg.get("eos_token_id")
    special |= set(eos) if isinstance(eos, list) else {eos}
    pool = [t for t in range(cfg["vocab_size"]) if t not in special]
    return {f"random-{i:02d}-len{n:03d}": [rng.choice(pool) for _ in range(n)] for i, n in enumerate(lengths)}


def text_prompts(spec: PairSpec) -> dict[str, list[int]]:
    if spec.tokenizer_path is None:
        return {}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(spec.tokenizer_path))
    return {name: tok.encode(text, add_special_tokens=False).ids for name, text in TEXT_PROMPTS.items()}


def prompt_recipe(spec: PairSpec) -> dict:
    return {
        "random": {
            "seed": spec.seed,
            "count": spec.num_random,
            "required_lengths": list(REQUIRED_LENGTHS),
            "other_lengths": "random.Random(seed).sample(3..254 minus required)",
            "tokens": "random.Random(seed).choice over ids except 0, BOS, EOS, MASK",
        },
        "text": sorted(TEXT_PROMPTS) if spec.tokenizer_path else [],
        "continuation": f"HF greedy, {spec.continuation_tokens} tokens, eos {spec.eos_token_id}",
    }


def prompt_set(spec: PairSpec) -> dict[str, list[int]]:
    return {**random_prompts(spec), **text_prompts(spec)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weight_hashes(spec: PairSpec) -> dict[str, str]:
    files = [
        p
        for d in (spec.target_dir, spec.draft_dir)
        if d.exists()
        for p in sorted(d.iterdir())
        if p.suffix in (".safetensors", ".json")
    ]
    return {str(p.relative_to(spec.target_dir.parent)): _sha256(p) for p in files}
