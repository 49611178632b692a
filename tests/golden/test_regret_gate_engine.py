"""The first-divergence regret gate on real engine outputs (CPU fp32): spec-on vs spec-off from refengine
passes it, and an engine with an acceptance bug (one draft too many accepted, a wrong token committed)
fails it with the numbers printed. The gate has teeth on the bug class it exists for.

Run: pytest tests/golden/test_regret_gate_engine.py
"""

from __future__ import annotations

import random

import refengine.scheduler.commit as scheduler_module  # where the commit calls build_verify_results
from golden.gates import MARGIN_TOL, first_divergence_regret_gate
from refengine.spec_decode.accept import VerifyResult, build_verify_results
from tests.adapter import cpu_engine, greedy, score_sequences


def _gate(pair, spec_engine):
    rng = random.Random(5)
    prompts = [[rng.randrange(1023) for _ in range(n)] for n in (3, 17, 40)]
    plain = greedy(cpu_engine(pair.target), prompts, 24)
    spec = greedy(spec_engine, prompts, 24)
    scorer = cpu_engine(pair.target)

    def score(ids):
        return score_sequences(scorer, [("rescore", ids[:-1], ids[-1:])])[0]

    return [
        first_divergence_regret_gate(p, b, s, score, tol=MARGIN_TOL, name=f"p{i}")
        for i, (p, b, s) in enumerate(zip(prompts, plain, spec))
    ]


def test_regret_gate_passes_the_engine(random_pair):
    for report in _gate(random_pair, cpu_engine(random_pair.target, random_pair.draft)):
        print(report)
        report.assert_passes()


def test_regret_gate_fails_an_off_by_one_acceptance(random_pair, monkeypatch):
    def accept_one_too_many(drafts, target_argmax, eos_ids, ignore_eos):
        out = []
        for r, d, t in zip(build_verify_results(drafts, target_argmax, eos_ids, ignore_eos), drafts, target_argmax):
            m = min(r.accepted + 1, len(d))  # the bug: the first mismatching draft is committed too
            out.append(VerifyResult(m, tuple(d[:m]) + (t[m],), False))
        return out

    monkeypatch.setattr(scheduler_module, "build_verify_results", accept_one_too_many)
    reports = _gate(random_pair, cpu_engine(random_pair.target, random_pair.draft))
    for r in reports:
        print(r)
    failed = [r for r in reports if not r.passed]
    assert failed, "the regret gate let an acceptance bug through"
    assert max(r.max_regret for r in failed) > 1.0, "a wrong committed token should sit far outside the tie band"
