"""Acceptance goldens: per-step committed lengths of golden's dense DFlash oracle, for the stored prompts.

For every greedy golden of a pair with a trained drafter (a pair whose target has a tokenizer), run
golden.oracle_dflash.oracle_spec_generate in the manifest's dtype (fp32) on CPU, with the greedy goldens'
budget and EOS, and store an AcceptanceRecord: the output (which must equal the HF greedy golden: the
oracle loop is lossless, so anything else means the oracle or the fixture is broken), the tokens each
verify step committed, and the drafter's top-1 minus top-2 logit at every drafted position of each step.
Never produced by refengine. Written by `python -m golden.regen` (golden/regen.py), into acceptance.jsonl.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm import tqdm

from golden.errors import GoldenError
from golden.gates import DRAFT_MARGIN_TOL
from golden.oracle_dflash import oracle_spec_generate
from golden.records import AcceptanceRecord, GreedyRecord

ACCEPTANCE_FILE = "acceptance.jsonl"
MARGIN_CHECK_TOL = 1e-4  # --check: a stored margin and a live one may differ by this much (nat)


def wants_acceptance(spec) -> bool:
    """Pairs with a trained drafter get acceptance goldens; a random drafter's tau ~1 pins nothing useful."""
    return spec.tokenizer_path is not None


def deciding_margins(rec: AcceptanceRecord) -> list[float]:
    """Per step, the golden drafter's margin at the draft that ended the accepted run (d_{a+1}); steps that
    accepted their whole span have none. A margin <= DRAFT_MARGIN_TOL is a near-tie an engine may flip."""
    out = []
    for c, row in zip(rec.accepted_lengths, rec.draft_margins):
        if c - 1 < len(row):
            out.append(row[c - 1])
    return out


def generate_acceptance(
    spec, greedy: Sequence[GreedyRecord], progress: bool = True
) -> tuple[list[AcceptanceRecord], dict]:
    """One oracle run per greedy golden; returns the records and the manifest section."""
    t0 = time.perf_counter()
    records = []
    for g in tqdm(greedy, desc=f"acceptance {spec.name}", disable=not progress, unit="seq"):
        run = oracle_spec_generate(
            spec.target_dir, spec.draft_dir, g.prompt_ids, spec.continuation_tokens, spec.eos_token_id, dtype=spec.dtype
        )
        if run.output_ids != list(g.output_ids):
            raise GoldenError(
                f"{g.name}: the oracle spec loop output differs from the HF greedy golden "
                f"(first 8: {run.output_ids[:8]} vs {list(g.output_ids)[:8]}): the loop is not lossless"
            )
        records.append(
            AcceptanceRecord(g.name, list(g.prompt_ids), run.output_ids, run.committed_lengths, run.draft_margins)
        )
    seconds = time.perf_counter() - t0
    steps = sum(len(r.accepted_lengths) for r in records)
    deciding = [m for r in records for m in deciding_margins(r)]
    section = {
        "file": ACCEPTANCE_FILE,
        "records": len(records),
        "steps": steps,
        "tau": round(sum(sum(r.accepted_lengths) for r in records) / max(steps, 1), 4),
        "generator": "golden.oracle_dflash.oracle_spec_generate (dense HF target + dense oracle drafter)",
        "budget": spec.continuation_tokens,
        "eos_token_id": spec.eos_token_id,
        "min_deciding_margin": round(min(deciding), 6) if deciding else None,
        "deciding_margins_below_tol": sum(m <= DRAFT_MARGIN_TOL for m in deciding),
        "draft_margin_tol": DRAFT_MARGIN_TOL,
        "seconds": round(seconds, 1),
    }
    return records, section


def compare_acceptance(stored: Sequence[AcceptanceRecord], live: Sequence[AcceptanceRecord]) -> list[str]:
    """Mismatch messages of live against stored (names live holds): outputs and steps exactly equal,
    margins within MARGIN_CHECK_TOL."""
    by_name = {r.name: r for r in stored}
    errors = []
    for lv in live:
        st = by_name.get(lv.name)
        if st is None:
            errors.append(f"{lv.name}: no stored acceptance record")
        elif st.output_ids != lv.output_ids or st.accepted_lengths != lv.accepted_lengths:
            errors.append(f"{lv.name}: acceptance stored {st.accepted_lengths} live {lv.accepted_lengths}")
        else:
            worst = max(
                (abs(a - b) for ra, rb in zip(st.draft_margins, lv.draft_margins) for a, b in zip(ra, rb)), default=0.0
            )
            if worst > MARGIN_CHECK_TOL:
                errors.append(f"{lv.name}: draft margins moved by {worst:.2e} > {MARGIN_CHECK_TOL}")
    return errors
