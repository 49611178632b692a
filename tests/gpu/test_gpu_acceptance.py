"""GPU acceptance in bf16 with the FlashInfer backend (marked `gpu`; skipped without CUDA), trained pair:
- tau over the 55 acceptance goldens (fp32 oracle, budget 24) at bs=1 stays within GPU_BF16_TAU_REL_TOL of
  the golden tau (bf16 flips drafter and target near-ties, so per-step equality is not required; the fp32
  acceptance gate's report is printed for information);
- acceptance batch invariance: per-request acceptance at concurrency 16 and 32 against the same requests run
  one at a time; tau at c16 / c32 >= GPU_BATCH_TAU_MIN_FRACTION x tau alone (acceptance_batch_invariance_gate;
  the llama.cpp #27117 class: acceptance collapsing under concurrency while outputs stay lossless).

Calibrated on the H200 on 2026-12-01 (bf16, FlashInfer fa2, graph mode full, engine at commit of that day):
tau 1.5315 against the golden 1.5259 (|ratio - 1| = 0.0037; 42 of 55 outputs identical to the fp32 goldens,
13 differ by bf16 tie flips); tau at c16 and c32 2.1064 against 2.1206 alone (ratio 0.9933). The fraction is
the observed ratio - 0.05; the tolerance is 8x the observed offset (0.03), since any bf16 kernel change moves
near-tie flips and with them a few steps' acceptance. Re-run with -s and re-calibrate when kernels change.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_acceptance.py -s
"""

from __future__ import annotations

import pytest

from golden.acceptance import acceptance_batch_invariance_gate, acceptance_gate
from golden.regen import load_golden
from refengine import SamplingParams
from tests.adapter import acceptance_record, assert_no_leftovers, gpu_engine, run_requests

pytestmark = pytest.mark.gpu

GPU_BF16_TAU_REL_TOL = 0.03  # |tau bf16 / tau golden fp32 - 1| allowed at bs=1 (observed 0.0037)
GPU_BATCH_TAU_MIN_FRACTION = 0.94  # tau at c16 / c32 over tau alone (observed 0.9933)
INVARIANCE_TOKENS = 64  # longer than the goldens' 24: more verify steps per request


def _run(pair, goldens, max_tokens, max_num_seqs):
    engine = gpu_engine(pair.target, pair.draft, max_num_seqs=max_num_seqs)
    reqs = run_requests(
        engine, [(g.prompt_ids, SamplingParams(max_tokens=max_tokens or len(g.output_ids))) for g in goldens]
    )
    records = [acceptance_record(g.name, r) for g, r in zip(goldens, reqs)]
    assert_no_leftovers(engine, f"gpu c{max_num_seqs}")
    return records


def test_gpu_bf16_tau_within_tolerance_of_the_goldens(trained_pair):
    goldens = load_golden(trained_pair.name).acceptance
    records = _run(trained_pair, goldens, None, 1)
    report = acceptance_gate(records, goldens)
    print(f"\n[informational, fp32 margins] {report}")
    ratio = report.engine_tau / report.golden_tau
    print(
        f"tau bf16 {report.engine_tau:.4f} / golden fp32 {report.golden_tau:.4f} = {ratio:.4f} "
        f"(tol {GPU_BF16_TAU_REL_TOL})"
    )
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
