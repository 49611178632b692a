"""GPU acceptance in bf16 with the FlashInfer backend (marked `gpu`; skipped without CUDA), trained pair:
- tau over the 55 acceptance goldens (fp32 oracle, budget 24) at bs=1 stays within GPU_BF16_TAU_REL_TOL of
  the golden tau (bf16 flips drafter and target near-ties, so per-step equality is not required; the fp32
  acceptance gate's report is printed for information);
- acceptance batch invariance: per-request acceptance at concurrency 16 and 32 against the same requests run
  one at a time; tau at c16 / c32 >= GPU_BATCH_TAU_MIN_FRACTION x tau alone (acceptance_batch_invariance_gate;
  the llama.cpp #27117 class: acceptance collapsing under concurrency while outputs stay lossless).

Both constants are UNCALIBRATED placeholders, to be fixed from the first H200 run: run
`python -m pytest -m gpu tests/gpu/test_gpu_acceptance.py -s`, read the printed ratios, and set each
constant to the observed figure with a margin (ratio - 0.05 for the fraction; |1 - ratio| x 2 for the
tolerance), recording the date, device and numbers in the comment, as golden/gates.py does for fp32.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_acceptance.py -s
"""
from __future__ import annotations

import pytest

from golden.acceptance import acceptance_batch_invariance_gate, acceptance_gate
from golden.regen import load_golden
from refengine import SamplingParams
from tests.adapter import acceptance_record, assert_no_leftovers, gpu_engine, run_requests

pytestmark = pytest.mark.gpu

GPU_BF16_TAU_REL_TOL = 0.10  # UNCALIBRATED: |tau bf16 / tau golden fp32 - 1| allowed at bs=1
GPU_BATCH_TAU_MIN_FRACTION = 0.90  # UNCALIBRATED: tau at c16 / c32 over tau alone
INVARIANCE_TOKENS = 64  # longer than the goldens' 24: more verify steps per request


def _run(pair, goldens, max_tokens, max_num_seqs):
    engine = gpu_engine(pair.target, pair.draft, max_num_seqs=max_num_seqs)
    reqs = run_requests(engine, [(g.prompt_ids, SamplingParams(max_tokens=max_tokens or len(g.output_ids)))
                                 for g in goldens])
    records = [acceptance_record(g.name, r) for g, r in zip(goldens, reqs)]
    assert_no_leftovers(engine, f"gpu c{max_num_seqs}")
    return records


def test_gpu_bf16_tau_within_tolerance_of_the_goldens(trained_pair):
    goldens = load_golden(trained_pair.name).acceptance
    records = _run(trained_pair, goldens, None, 1)
    report = acceptance_gate(records, goldens)
    print(f"\n[informational, fp32 margins] {report}")
    ratio = report.engine_tau / report.golden_tau
    print(f"tau bf16 {report.engine_tau:.4f} / golden fp32 {report.golden_tau:.4f} = {ratio:.4f} "
          f"(tol {GPU_BF16_TAU_REL_TOL})")
    assert abs(ratio - 1) <= GPU_BF16_TAU_REL_TOL, f"tau ratio {ratio:.4f} outside 1 +- {GPU_BF16_TAU_REL_TOL}"


@pytest.fixture(scope="module")
def alone_records(trained_pair):
    goldens = load_golden(trained_pair.name).acceptance
    return goldens, _run(trained_pair, goldens, INVARIANCE_TOKENS, 1)


@pytest.mark.parametrize("concurrency", [16, 32])
def test_gpu_acceptance_batch_invariance(trained_pair, alone_records, concurrency):
    goldens, alone = alone_records
    concurrent = _run(trained_pair, goldens, INVARIANCE_TOKENS, concurrency)
    report = acceptance_batch_invariance_gate(alone, concurrent, min_fraction=GPU_BATCH_TAU_MIN_FRACTION)
    print(f"\n[c{concurrency}] {report}")
    report.assert_passes()
