"""Coverage is enforced by every gate (golden/coverage.py): hf_gate, greedy_gate and acceptance_gate raise
CoverageError, with a message naming what is missing or wrong, for no engine records, partial coverage
(the regression: hf_gate used to PASS an empty list and 1 of 55 records), a name twice on either side, a
name the golden lacks, different input ids, and (hf_gate) top-k rows narrower than 8. An explicit subset
(`names=`) gates exactly the named records and nothing else. Synthetic records plus the stored goldens.

Run: pytest tests/golden/test_coverage.py
"""

from __future__ import annotations

import dataclasses

import pytest

from golden.acceptance import acceptance_gate
from golden.errors import CoverageError
from golden.gates import FP32, hf_gate
from golden.greedy_gate import greedy_gate
from golden.records import AcceptanceRecord, GreedyRecord, TopKRecord
from golden.regen import load_golden


def topk(name: str, ids=(1, 2, 3), k: int = 8) -> TopKRecord:
    rows = [[(t + j) % 50 for j in range(k)] for t in ids]
    return TopKRecord(name, list(ids), rows, [[-0.1 * (j + 1) for j in range(k)] for _ in ids])


def greedy(name: str, ids=(1, 2, 3)) -> GreedyRecord:
    return GreedyRecord(name, list(ids), [7, 8, 9])


def acceptance(name: str, ids=(1, 2, 3)) -> AcceptanceRecord:
    return AcceptanceRecord(name, list(ids), [7, 8, 9], [2])


GATES = {
    "hf_gate": (topk, lambda e, g, **kw: hf_gate(e, g, FP32, **kw), "token_ids"),
    "greedy_gate": (greedy, greedy_gate, "prompt_ids"),
    "acceptance_gate": (acceptance, acceptance_gate, "prompt_ids"),
}


@pytest.fixture(params=sorted(GATES))
def gate(request):
    return GATES[request.param]


def test_full_coverage_passes(gate):
    make, run, _ = gate
    golden = [make("a"), make("b"), make("c")]
    report = run(golden, golden)
    assert report.passed and report.coverage.gated == 3 and not report.coverage.subset


@pytest.mark.parametrize(
    "case,engine_names,golden_names,message",
    [
        ("empty", [], ["a", "b"], "no engine records: nothing was gated against the 2"),
        (
            "partial",
            ["a"],
            ["a", "b", "c"],
            "partial coverage: engine wrote 1 of the 3 .* records; missing 2: 'b', 'c'",
        ),
        ("engine duplicate", ["a", "a", "b"], ["a", "b"], "engine records hold these names more than once: 'a'"),
        ("golden duplicate", ["a"], ["a", "a"], "records hold these names more than once: 'a'"),
        ("unknown name", ["a", "b", "zz"], ["a", "b"], "engine records with no .* record: 'zz'"),
    ],
)
def test_coverage_errors(gate, case, engine_names, golden_names, message):
    make, run, _ = gate
    with pytest.raises(CoverageError, match=message):
        run([make(n) for n in engine_names], [make(n) for n in golden_names])


def test_different_input_ids(gate):
    make, run, label = gate
    with pytest.raises(
        CoverageError,
        match=f"b: engine and .* records hold different {label} "
        r"\(first difference at 1, lengths 3 vs 3\)",
    ):
        run([make("a"), make("b", ids=(1, 5, 3))], [make("a"), make("b")])


def test_explicit_subset(gate):
    make, run, _ = gate
    golden = [make(n) for n in "abcd"]
    report = run([make("b"), make("d")], golden, names=["b", "d"])
    assert report.passed and report.coverage.gated == 2 and report.coverage.subset
    assert "2 of 4 golden records (explicit subset)" in str(report)
    with pytest.raises(CoverageError, match="partial coverage: engine wrote 1 of the 2 named subset; missing 1: 'd'"):
        run([make("b")], golden, names=["b", "d"])
    with pytest.raises(CoverageError, match="engine records outside the named subset of 1: 'd'"):
        run([make("b"), make("d")], golden, names=["b"])
    with pytest.raises(CoverageError, match="subset names not in the .* records: 'q'"):
        run([make("b")], golden, names=["b", "q"])


def test_hf_gate_needs_k8():
    golden = [topk("a", k=20), topk("b", k=20)]
    with pytest.raises(CoverageError, match=r"need k >= 8 .* 1 have fewer: b \(k=5\)"):
        hf_gate([topk("a"), topk("b", k=5)], golden)


def test_stored_goldens_regression():
    """The two cases issue 13 names: on the stored trained goldens, an empty list and 1 of 55 records."""
    hf = load_golden("tiny-trained").topk
    with pytest.raises(CoverageError, match="no engine records: nothing was gated against the 55 HF records"):
        hf_gate([], hf)
    one = dataclasses.replace(
        hf[0], topk_ids=[r[:8] for r in hf[0].topk_ids], topk_logprobs=[r[:8] for r in hf[0].topk_logprobs]
    )
    with pytest.raises(CoverageError, match="partial coverage: engine wrote 1 of the 55 HF records; missing 54"):
        hf_gate([one], hf)
    assert hf_gate([one], hf, FP32, names=[one.name]).passed  # said explicitly, a subset is fine
