"""refengine's acceptance against the acceptance goldens (golden/data/tiny-trained/acceptance.jsonl, made by
golden's dense oracle loop in fp32, never by refengine), CPU fp32: every verify step must commit exactly
the golden's number of tokens (golden.acceptance.acceptance_gate; a step may differ only at a drafter
near-tie, printed), at bs=1 and inside a concurrent batch with heterogeneous budgets (1, 2, 9, 15, 16, 17,
24: expected sequences derived exactly by truncate_to_budget) and staggered arrival. And the gate has teeth
where losslessness has none: drafter features from the wrong tap layer, or a batched prefill handing each
request its neighbour's rows, keep every output equal to the golden yet fail the acceptance gate. The
batch-invariance gate (concurrent vs alone) passes the engine at ratio 1 and fails an engine whose batched
propose hands each request its neighbour's drafts (lossless, invisible at bs=1, tau collapses).

Run: pytest tests/golden/test_acceptance_engine.py          (the full bs=1 sweep over all 55: -m slow)
"""

from __future__ import annotations

import pytest

from golden.acceptance import acceptance_batch_invariance_gate, acceptance_gate, truncate_to_budget
from golden.greedy_gate import greedy_gate
from golden.records import GreedyRecord
from golden.regen import load_golden
from refengine import SamplingParams
from tests.adapter import (
    FeatureRecorder,
    acceptance_record,
    assert_no_leftovers,
    break_rotate_batched_drafts,
    break_rotate_batched_prefill_features,
    break_tap_layers_off_by_one,
    cpu_engine,
    run_requests,
)

BUDGETS = [24, 1, 2, 15, 16, 17, 24, 9]  # around the block size 16; the goldens' own budget is 24


def _goldens(pair):
    return load_golden(pair.name).acceptance


def _bs1_subset(goldens):
    """Every text prompt (code / prose / chat: the long accepted runs) and every 6th random one."""
    return [g for i, g in enumerate(goldens) if not g.name.startswith("random-") or i % 6 == 0]


def _run(pair, goldens, budgets=None, stagger_after=None, breakage=None, **engine_kw):
    budgets = budgets or [len(g.output_ids) for g in goldens]
    engine = cpu_engine(pair.target, pair.draft, **engine_kw)
    if breakage is not None:
        breakage(engine)
    recorder = FeatureRecorder(engine)
    reqs = run_requests(
        engine,
        [(g.prompt_ids, SamplingParams(max_tokens=b)) for g, b in zip(goldens, budgets)],
        stagger_after=stagger_after,
    )
    records = [acceptance_record(g.name, r) for g, r in zip(goldens, reqs)]
    assert_no_leftovers(engine, "acceptance run")
    verify_batches = [n for _, _, _, kind, n in recorder.calls if kind == "VerifyPlan"]
    return records, max(verify_batches, default=0)


def test_acceptance_bs1_reproduces_the_goldens(trained_pair):
    goldens = _bs1_subset(_goldens(trained_pair))
    records, widest = _run(trained_pair, goldens, max_num_seqs=1)
    assert widest == 1
    report = acceptance_gate(records, goldens, names=[g.name for g in goldens])  # explicit subset
    print(report)
    report.assert_passes()
    assert report.steps_compared == report.golden_steps > 100


@pytest.mark.slow
def test_acceptance_bs1_every_golden(trained_pair):
    goldens = _goldens(trained_pair)
    records, _ = _run(trained_pair, goldens, max_num_seqs=1)
    report = acceptance_gate(records, goldens)
    print(report)
    report.assert_passes()


def test_acceptance_concurrent_heterogeneous_staggered(trained_pair):
    goldens = _goldens(trained_pair)
    budgets = [BUDGETS[i % len(BUDGETS)] for i in range(len(goldens))]
    expected = [truncate_to_budget(g, b) for g, b in zip(goldens, budgets)]
    records, widest = _run(trained_pair, goldens, budgets, stagger_after=len(goldens) // 2)
    assert widest >= 16, f"the batch never got concurrent: widest verify plan {widest} requests"
    report = acceptance_gate(records, expected)
    print(report, f"\nwidest verify plan: {widest} requests")
    report.assert_passes()
    assert report.steps_compared == report.golden_steps


def _lossless_but_acceptance_fails(pair, goldens, breakage, **engine_kw):
    records, _ = _run(pair, goldens, breakage=breakage, **engine_kw)
    lossless = greedy_gate(
        [GreedyRecord(r.name, r.prompt_ids, r.output_ids) for r in records],
        [GreedyRecord(g.name, g.prompt_ids, g.output_ids) for g in goldens],
    )
    print(lossless)
    lossless.assert_passes()  # the bug is invisible to every lossless check ...
    report = acceptance_gate(records, goldens)
    print(report)
    assert not report.passed, "the acceptance gate let a drafter-input bug through"  # ... but not to this one
    return report


def test_acceptance_gate_fails_tap_layers_off_by_one(trained_pair):
    goldens = [g for g in _goldens(trained_pair) if not g.name.startswith("random-")]  # 7 text prompts
    report = _lossless_but_acceptance_fails(trained_pair, goldens, break_tap_layers_off_by_one)
    assert len(report.failures) >= 3


def test_acceptance_gate_fails_neighbouring_prefill_features(trained_pair):
    goldens = [g for g in _goldens(trained_pair) if not g.name.startswith("random-")]  # one batched prefill
    report = _lossless_but_acceptance_fails(trained_pair, goldens, break_rotate_batched_prefill_features)
    assert len(report.failures) >= 3


def test_batch_invariance_gate_on_the_engine(trained_pair):
    goldens = [g for g in _goldens(trained_pair) if not g.name.startswith("random-")]
    alone, _ = _run(trained_pair, goldens, max_num_seqs=1)
    together, widest = _run(trained_pair, goldens)
    assert widest == len(goldens)
    report = acceptance_batch_invariance_gate(alone, together, min_fraction=1.0, per_request_min_fraction=1.0)
    print(report)
    report.assert_passes()  # CPU fp32: acceptance is exactly batch-invariant
    broken_alone, _ = _run(trained_pair, goldens, max_num_seqs=1, breakage=break_rotate_batched_drafts)
    assert acceptance_gate(broken_alone, goldens).passed, "at bs=1 there is no neighbour: the bug is invisible"
    broken, _ = _run(trained_pair, goldens, breakage=break_rotate_batched_drafts)
    assert greedy_gate(
        [GreedyRecord(r.name, r.prompt_ids, r.output_ids) for r in broken],
        [GreedyRecord(g.name, g.prompt_ids, g.output_ids) for g in goldens],
    ).passed
    bad = acceptance_batch_invariance_gate(broken_alone, broken, min_fraction=0.9)
    print(bad)
    assert not bad.passed and bad.ratio < 0.8, str(bad)
