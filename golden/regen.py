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
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from golden import hf_reference
from golden.pairs import (
    PairSpec,
    available_pairs,
    pair_spec,
    prompt_recipe,
    prompt_set,
    spec_from_manifest,
    weight_hashes,
)
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

DATA = Path(__file__).resolve().parent / "data"
LOGPROB_TOL = 1e-4
GREEDY_FILE, TOPK_FILE, MANIFEST_FILE = "greedy.jsonl", "topk.jsonl.gz", "manifest.json"


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
