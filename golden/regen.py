"""Regenerate (or --check) the stored goldens of a model pair.

    python -m golden.regen [--pair tiny-random]            # rewrite golden/data/<pair>/
    python -m golden.regen [--pair tiny-random] --check    # recompute live, compare, exit 1 on mismatch

Per pair: prompts (seeded random tokens of lengths 1..256; plus code / prose / chat text when the target
dir has a tokenizer.json), each extended by HF greedy, plus teacher-forced top-k logprobs at every
position of prompt + continuation, all with HF transformers in fp32 on CPU. Files: greedy.jsonl,
topk.jsonl.gz (golden/records.py schema) and manifest.json (versions, dtype, seed, k, weight hashes,
the prompt recipe). Pairs with a trained drafter also get acceptance.jsonl (golden/regen_acceptance.py):

    python -m golden.regen --pair tiny-trained --part acceptance   # only the acceptance goldens
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from golden import hf_reference
from golden.records import (
    AcceptanceRecord,
    GreedyRecord,
    TopKRecord,
    read_acceptance_jsonl,
    read_greedy_jsonl,
    read_topk_jsonl,
    write_jsonl,
)
from golden.regen_acceptance import ACCEPTANCE_FILE, compare_acceptance, generate_acceptance, wants_acceptance

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
DATA = Path(__file__).resolve().parent / "data"
REQUIRED_LENGTHS = (1, 2, 15, 16, 17, 31, 32, 33, 127, 128, 255, 256)  # around the 16-token block/page edges
LOGPROB_TOL = 1e-4
GREEDY_FILE, TOPK_FILE, MANIFEST_FILE = "greedy.jsonl", "topk.jsonl.gz", "manifest.json"

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


@dataclass
class GoldenSet:
    manifest: dict
    greedy: list[GreedyRecord]
    topk: list[TopKRecord]
    acceptance: list[AcceptanceRecord] = dataclasses.field(default_factory=list)  # trained pairs only


def generate(
    spec: PairSpec, names: Sequence[str] | None = None, progress: bool = True, acceptance: bool = True
) -> GoldenSet:
    """Run HF for the pair's prompts (only `names` when given): greedy, then teacher-forced top-k; then the
    oracle spec loop for the acceptance goldens when the pair wants them (and `acceptance`)."""
    prompts = prompt_set(spec)
    if names is not None:
        prompts = {n: prompts[n] for n in names}
    greedy, topk = [], []
    for name, ids in tqdm(prompts.items(), desc=f"golden {spec.name}", disable=not progress, unit="seq"):
        g = hf_reference.greedy(
            spec.target_dir, {name: ids}, spec.continuation_tokens, spec.eos_token_id, dtype=spec.dtype
        )[0]
        greedy.append(g)
        topk += hf_reference.teacher_forced_topk(
            spec.target_dir, {name: ids + g.output_ids}, k=spec.k, dtype=spec.dtype
        )
    manifest = {
        "pair": spec.name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "device": "cpu",
        "attn_implementation": "eager",
        "seed": spec.seed,
        "k": spec.k,
        "continuation_tokens": spec.continuation_tokens,
        "eos_token_id": spec.eos_token_id,
        "sequences": len(greedy),
        "positions": sum(len(r.token_ids) for r in topk),
        "weights_sha256": weight_hashes(spec),
        "prompt_recipe": prompt_recipe(spec),
        "files": [GREEDY_FILE, TOPK_FILE],
    }
    golden = GoldenSet(manifest=manifest, greedy=greedy, topk=topk)
    if acceptance and wants_acceptance(spec):
        add_acceptance(golden, spec, progress)
    return golden


def add_acceptance(golden: GoldenSet, spec: PairSpec, progress: bool = True) -> None:
    """Acceptance goldens for the set's greedy prompts, recorded in its manifest."""
    golden.acceptance, section = generate_acceptance(spec, golden.greedy, progress)
    golden.manifest["acceptance"] = section
    golden.manifest["files"] = [f for f in golden.manifest["files"] if f != ACCEPTANCE_FILE] + [ACCEPTANCE_FILE]


def write_golden(golden: GoldenSet, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / GREEDY_FILE, golden.greedy)
    write_jsonl(out_dir / TOPK_FILE, golden.topk)
    if golden.acceptance:
        write_jsonl(out_dir / ACCEPTANCE_FILE, golden.acceptance)
    (out_dir / MANIFEST_FILE).write_text(json.dumps(golden.manifest, indent=2) + "\n")


def load_golden(pair: str, data_root: Path = DATA) -> GoldenSet:
    """The stored goldens of `pair` (records in stored order)."""
    d = data_root / pair
    if not (d / MANIFEST_FILE).exists():
        raise FileNotFoundError(f"no stored goldens for {pair!r} under {d}: run python -m golden.regen --pair {pair}")
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    acceptance = read_acceptance_jsonl(d / ACCEPTANCE_FILE) if ACCEPTANCE_FILE in manifest["files"] else []
    return GoldenSet(
        manifest=manifest,
        greedy=read_greedy_jsonl(d / GREEDY_FILE),
        topk=read_topk_jsonl(d / TOPK_FILE),
        acceptance=acceptance,
    )


def _compare_rows(name: str, stored: TopKRecord, live: TopKRecord, tol: float, stats: dict) -> list[str]:
    """Logprobs of shared tokens within tol; a token in only one top-k must sit within tol of the other's
    k-th logprob (a legitimate swap at the boundary), else it is a mismatch."""
    errors = []
    for p in range(len(stored.token_ids)):
        s = dict(zip(stored.topk_ids[p], stored.topk_logprobs[p]))
        lv = dict(zip(live.topk_ids[p], live.topk_logprobs[p]))
        for tok in s.keys() & lv.keys():
            stats["max_delta"] = max(stats["max_delta"], abs(s[tok] - lv[tok]))
            if abs(s[tok] - lv[tok]) > tol:
                errors.append(
                    f"{name} pos {p} token {tok}: logprob stored {s[tok]:.6f} live {lv[tok]:.6f} "
                    f"(|d| {abs(s[tok] - lv[tok]):.2e} > {tol})"
                )
        for only, other, which in ((s.keys() - lv.keys(), lv, "stored"), (lv.keys() - s.keys(), s, "live")):
            src = s if which == "stored" else lv
            for tok in only:
                stats["boundary_swaps"] += 1
                if src[tok] - min(other.values()) > tol:
                    errors.append(
                        f"{name} pos {p}: token {tok} (lp {src[tok]:.6f}) only in {which} top-k, "
                        f"other k-th lp {min(other.values()):.6f}"
                    )
        stats["positions"] += 1
    return errors


def compare(stored: GoldenSet, live: GoldenSet, tol: float = LOGPROB_TOL) -> tuple[list[str], dict]:
    """Mismatch messages (with numbers) of live against stored, for the names live holds; and stats."""
    stats = {"sequences": 0, "positions": 0, "max_delta": 0.0, "boundary_swaps": 0}
    errors: list[str] = []
    greedy_by_name = {r.name: r for r in stored.greedy}
    topk_by_name = {r.name: r for r in stored.topk}
    for g in live.greedy:
        sg = greedy_by_name.get(g.name)
        if sg is None:
            errors.append(f"{g.name}: not in stored goldens")
            continue
        stats["sequences"] += 1
        if sg.prompt_ids != g.prompt_ids:
            errors.append(f"{g.name}: prompt ids differ (recipe changed?)")
        elif sg.output_ids != g.output_ids:
            j = next(
                (i for i, (a, b) in enumerate(zip(sg.output_ids, g.output_ids)) if a != b),
                min(len(sg.output_ids), len(g.output_ids)),
            )
            errors.append(
                f"{g.name}: greedy output differs first at generated index {j}: stored "
                f"{sg.output_ids[j : j + 3]} live {g.output_ids[j : j + 3]}"
            )
    for t in live.topk:
        st = topk_by_name.get(t.name)
        if st is not None and st.token_ids == t.token_ids:
            errors += _compare_rows(t.name, st, t, tol, stats)
    return errors, stats


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="tiny-random", help=f"fixture pair ({', '.join(available_pairs())})")
    ap.add_argument("--check", action="store_true", help="recompute live and compare with the stored data")
    ap.add_argument("--limit", type=int, default=None, help="--check only N evenly spaced sequences")
    ap.add_argument("--data-root", type=Path, default=DATA)
    ap.add_argument("--seed", type=int, default=PairSpec.seed)
    ap.add_argument("--continuation-tokens", type=int, default=PairSpec.continuation_tokens)
    ap.add_argument(
        "--part",
        choices=["all", "acceptance"],
        default="all",
        help="acceptance: only (re)write acceptance.jsonl from the stored greedy goldens",
    )
    args = ap.parse_args(argv)
    spec = dataclasses.replace(pair_spec(args.pair), seed=args.seed, continuation_tokens=args.continuation_tokens)
    if args.part == "acceptance" and not args.check:
        stored = load_golden(spec.name, args.data_root)
        add_acceptance(stored, spec_from_manifest(spec, stored.manifest))
        write_golden(stored, args.data_root / spec.name)
        a = stored.manifest["acceptance"]
        print(
            f"wrote {a['records']} acceptance records, {a['steps']} steps (tau {a['tau']}) in {a['seconds']} s; "
            f"deciding margins <= {a['draft_margin_tol']}: {a['deciding_margins_below_tol']} (min "
            f"{a['min_deciding_margin']})"
        )
        return 0
    if not args.check:
        golden = generate(spec)
        write_golden(golden, args.data_root / spec.name)
        print(
            f"wrote {golden.manifest['sequences']} sequences, {golden.manifest['positions']} positions "
            f"to {args.data_root / spec.name}"
        )
        return 0
    stored = load_golden(spec.name, args.data_root)
    spec = spec_from_manifest(spec, stored.manifest)
    names = [r.name for r in stored.greedy]
    if args.limit:
        names = names[:: max(1, len(names) // args.limit)][: args.limit]
    errors = [
        f"weights changed since the goldens were made: {f}"
        for f, h in weight_hashes(spec).items()
        if stored.manifest["weights_sha256"].get(f) != h
    ]
    live = generate(spec, names=names, acceptance=bool(stored.acceptance))
    cmp_errors, stats = compare(stored, live)
    errors += cmp_errors + compare_acceptance(stored.acceptance, live.acceptance)
    versions = (
        f"stored torch {stored.manifest['torch']} / transformers {stored.manifest['transformers']}, "
        f"live {torch.__version__} / {transformers.__version__}"
    )
    print(
        f"checked {stats['sequences']} sequences, {stats['positions']} positions: max |d logprob| "
        f"{stats['max_delta']:.2e} (tol {LOGPROB_TOL}), boundary swaps {stats['boundary_swaps']}; {versions}"
    )
    if live.acceptance:
        print(
            f"checked {len(live.acceptance)} acceptance records, "
            f"{sum(len(r.accepted_lengths) for r in live.acceptance)} steps"
        )
    for e in errors[:30]:
        print("MISMATCH", e)
    if errors:
        print(f"{len(errors)} mismatches")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
