"""Unit tests of golden/acceptance.py and the stored acceptance goldens, mostly on synthetic records.

acceptance_gate: identical records pass; a step that commits a different length fails with the step, both
lengths and the golden drafter margin printed, unless that margin is a near-tie (<= DRAFT_MARGIN_TOL),
which passes and is reported; an output difference fails with its position. truncate_to_budget equals the
oracle loop re-run at the smaller budget. acceptance_batch_invariance_gate passes equal acceptance and fails
a collapse with the ratio printed. AcceptanceRecord validation and JSONL round trip. The stored goldens
agree with the greedy goldens and their manifest, and regen --check's comparison flags a changed step or margin.

Run: pytest tests/golden/test_acceptance_gate.py
"""

from __future__ import annotations

import dataclasses

import pytest

from golden.acceptance import acceptance_batch_invariance_gate, acceptance_gate, truncate_to_budget
from golden.errors import GoldenError, RecordError
from golden.gates import DRAFT_MARGIN_TOL
from golden.oracle_dflash import oracle_spec_generate
from golden.pairs import pair_spec
from golden.records import AcceptanceRecord, read_records, write_jsonl
from golden.regen import load_golden
from golden.regen_acceptance import compare_acceptance, deciding_margins


def rec(name: str, steps: list[int], margins: list[list[float]] | None = None, prompt=(5, 6)) -> AcceptanceRecord:
    """A record whose budget is its output length; default margins 1.0 at every drafted position of each
    step's span min(16, budget - generated)."""
    out = list(range(100, 101 + sum(steps)))
    if margins is None:
        margins, generated = [], 1
        for c in steps:
            margins.append([1.0] * (min(16, len(out) - generated) - 1))
            generated += c
    return AcceptanceRecord(name, list(prompt), out, steps, margins)


GOLDEN = [rec("a", [1, 3, 2, 1]), rec("b", [16, 4]), rec("c", [])]


def test_identical_passes():
    report = acceptance_gate(GOLDEN, GOLDEN)
    assert report.passed and report.identical == 3 and report.steps_compared == report.golden_steps == 6
    report.assert_passes()
    assert "PASS" in str(report) and "tau engine 4.5000 vs golden 4.5000" in str(report)


def test_step_difference_fails_with_numbers():
    engine = [GOLDEN[0], rec("b", [15, 5]), GOLDEN[2]]  # step 0 commits 15, the golden 16
    report = acceptance_gate(engine, GOLDEN)
    assert not report.passed and len(report.failures) == 1
    with pytest.raises(AssertionError) as err:
        report.assert_passes()
    text = str(err.value)
    assert "b step 0: committed 15, golden 16; deciding draft d_15" in text and "margin 1.000000" in text
    assert "NOT a near-tie" in text


def test_near_tie_difference_passes_and_is_reported():
    margins = [[1.0] * 15, [1.0, 1.0, 0.9 * DRAFT_MARGIN_TOL] + [1.0] * 12, [1.0] * 15, [1.0] * 15]
    golden = [rec("a", [1, 3, 2, 1], margins)]
    engine = [rec("a", [1, 4, 1, 1])]  # step 1: the engine accepted d_3 too, where the golden drafter tied
    report = acceptance_gate(engine, golden)
    assert report.passed, str(report)
    (tie,) = report.near_ties
    assert (tie.step, tie.got, tie.want, tie.draft_index, tie.near_tie) == (1, 4, 3, 3, True)
    assert report.steps_compared == 1 and "near-tie (allowed)" in str(report)
    # the same difference where the golden drafter was decisive fails
    margins[1][2] = 2 * DRAFT_MARGIN_TOL
    assert not acceptance_gate(engine, [rec("a", [1, 3, 2, 1], margins)]).passed
    # and a golden without margins cannot excuse anything
    assert not acceptance_gate(engine, [rec("a", [1, 3, 2, 1], [])]).passed


def test_output_difference_fails_at_its_position():
    bad = dataclasses.replace(GOLDEN[0], output_ids=GOLDEN[0].output_ids[:4] + [7] + GOLDEN[0].output_ids[5:])
    report = acceptance_gate([bad, GOLDEN[1], GOLDEN[2]], GOLDEN)
    assert not report.passed
    assert "a: output differs from the golden at generated position 4" in report.failures[0]


def test_record_validation_and_round_trip(tmp_path):
    with pytest.raises(RecordError, match=r"1 \+ sum\(accepted_lengths\) = 4 but 3 output ids"):
        AcceptanceRecord("x", [1], [1, 2, 3], [1, 2])
    with pytest.raises(RecordError, match="must be >= 1"):
        AcceptanceRecord("x", [1], [1, 2], [1, 0])
    with pytest.raises(RecordError, match="1 draft_margins rows for 2 steps"):
        AcceptanceRecord("x", [1], [1, 2, 3], [1, 1], [[0.5]])
    path = write_jsonl(tmp_path / "acc.jsonl", GOLDEN + [rec("d", [2], [])])
    back = read_records(path)
    assert back == GOLDEN + [rec("d", [2], [])] and all(isinstance(r, AcceptanceRecord) for r in back)
    path.write_text(path.read_text() + '{"name": "e", "prompt_ids": [1]\n')
    with pytest.raises(RecordError, match=r"acc.jsonl:5: not JSON"):
        read_records(path)


# ---------------------------------------------------------------- truncate_to_budget


def test_truncate_to_budget_arithmetic():
    r = rec("a", [1, 3, 2, 1])  # outputs 8 tokens
    assert truncate_to_budget(r, 8) == r
    assert truncate_to_budget(r, 1).accepted_lengths == [] and truncate_to_budget(r, 1).output_ids == r.output_ids[:1]
    assert truncate_to_budget(r, 4).accepted_lengths == [1, 2]  # step 1 verifies min(B, 2) tokens: commits 2
    assert truncate_to_budget(r, 4).draft_margins == [[1.0] * 2, [1.0]]  # spans 3 and 2
    with pytest.raises(GoldenError, match="budget 9 outside 1..8"):
        truncate_to_budget(r, 9)


def test_truncate_to_budget_equals_the_oracle_rerun():
    spec = pair_spec("tiny-trained")
    stored = {r.name: r for r in load_golden("tiny-trained").acceptance}
    for name, budget in (("code-sort", 13), ("prose-river", 5)):
        g = stored[name]
        run = oracle_spec_generate(spec.target_dir, spec.draft_dir, g.prompt_ids, budget, spec.eos_token_id)
        want = truncate_to_budget(g, budget)
        assert run.committed_lengths == want.accepted_lengths and run.output_ids == want.output_ids, name
        assert max(abs(a - b) for ra, rb in zip(run.draft_margins, want.draft_margins) for a, b in zip(ra, rb)) < 1e-4


# ---------------------------------------------------------------- batch invariance


def test_batch_invariance_passes_equal_and_fails_a_collapse():
    alone = [rec("a", [3, 3, 3]), rec("b", [5, 5])]
    report = acceptance_batch_invariance_gate(alone, alone, min_fraction=0.95, per_request_min_fraction=0.9)
    assert report.passed and report.ratio == 1.0
    collapsed = [rec("a", [1] * 9), rec("b", [5, 5])]  # request a's tau 3 -> 1 at concurrency
    report = acceptance_batch_invariance_gate(alone, collapsed, min_fraction=0.95)
    assert not report.passed and report.ratio == pytest.approx((19 / 11) / (19 / 5))
    assert "tau concurrent 1.7273 / alone 3.8000 = 0.4545 (min 0.95)" in str(report)
    assert "worst request a: tau alone 3.000, concurrent 1.000, ratio 0.333" in str(report)
    mild = [rec("a", [3, 3, 2, 1]), rec("b", [5, 5])]  # aggregate (19/6) / 3.8 = 0.833, request a 0.75
    assert acceptance_batch_invariance_gate(alone, mild, min_fraction=0.8).passed
    per = acceptance_batch_invariance_gate(alone, mild, min_fraction=0.8, per_request_min_fraction=0.8)
    assert not per.passed and "a: tau alone 3.000, concurrent 2.250, ratio 0.750 < 0.8" in str(per)
    with pytest.raises(GoldenError, match="no verify steps"):
        acceptance_batch_invariance_gate([rec("c", [])], [rec("c", [])], min_fraction=0.9)


# ---------------------------------------------------------------- the stored goldens


def test_stored_acceptance_goldens_are_consistent():
    stored = load_golden("tiny-trained")
    greedy = {g.name: g for g in stored.greedy}
    acc = stored.acceptance
    assert [a.name for a in acc] == list(greedy) and len(acc) == 55
    for a in acc:
        g = greedy[a.name]
        assert a.prompt_ids == g.prompt_ids and a.output_ids == g.output_ids, a.name
        assert len(a.draft_margins) == len(a.accepted_lengths) and all(m >= 0 for row in a.draft_margins for m in row)
    section = stored.manifest["acceptance"]
    assert section["steps"] == sum(len(a.accepted_lengths) for a in acc)
    assert section["draft_margin_tol"] == DRAFT_MARGIN_TOL
    deciding = [m for a in acc for m in deciding_margins(a)]
    assert section["deciding_margins_below_tol"] == sum(m <= DRAFT_MARGIN_TOL for m in deciding)
    print(
        f"{len(acc)} records, {section['steps']} steps, tau {section['tau']}, min deciding margin {min(deciding):.6f}"
    )


def test_regen_check_flags_changed_acceptance():
    stored = load_golden("tiny-trained").acceptance
    assert compare_acceptance(stored, stored) == []
    a = next(r for r in stored if any(c > 1 for c in r.accepted_lengths[:-1]))
    moved = [list(row) for row in a.draft_margins]
    moved[0][0] += 1e-3
    errors = compare_acceptance(stored, [dataclasses.replace(a, draft_margins=moved)])
    assert errors == [f"{a.name}: draft margins moved by 1.00e-03 > 0.0001"], errors
    steps = list(a.accepted_lengths)
    i = next(j for j, c in enumerate(steps[:-1]) if c > 1)
    steps[i], steps[i + 1] = steps[i] - 1, steps[i + 1] + 1  # same output, one token moved to the next step
    (error,) = compare_acceptance(stored, [dataclasses.replace(a, accepted_lengths=steps)])
    assert error.startswith(f"{a.name}: acceptance stored {a.accepted_lengths} live {steps}")
