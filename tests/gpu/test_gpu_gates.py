"""GPU gates in bf16 with the FlashInfer backend (marked `gpu`; skipped without CUDA):
the HF gate against the stored fp32 HF goldens at bs=1 and all sequences in one batch (bf16 tolerances:
margin 0.20, head-delta mean 0.06, p99 0.20); and lossless speculative decoding gated by the
first-divergence regret gate with re-anchoring (bf16 tie flips pass, real bugs do not), at bs=1 and
concurrently with heterogeneous budgets, with the KV integrity check after every scenario.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu      (lossless only: -m gpu -k lossless)
"""

from __future__ import annotations

import json
import random

import pytest

from golden.gates import BF16, MARGIN_TOL, first_divergence_regret_gate, hf_gate
from golden.regen import load_golden
from tests.adapter import gpu_engine, greedy, score_sequences

pytestmark = pytest.mark.gpu
B = 16


def _golden_seqs(pair):
    if pair.golden is None:
        pytest.skip(f"pair {pair.name} has no stored goldens")
    g = load_golden(pair.name)
    return [(r.name, list(r.prompt_ids), list(r.output_ids)) for r in g.greedy], g.topk


@pytest.mark.parametrize("batched", [False, True], ids=["bs1", "batched"])
def test_gpu_hf_gate_bf16_flashinfer(model_pair, batched):
    seqs, hf = _golden_seqs(model_pair)
    engine = gpu_engine(model_pair.target, max_num_seqs=len(seqs) if batched else 1, max_prefill_tokens=1 << 16)
    report = hf_gate(score_sequences(engine, seqs), hf, BF16)
    print(f"\n[{model_pair.name} {'batched' if batched else 'bs=1'}] {report}")
    report.assert_passes()
    engine.check_integrity()


def _prompts(pair, n, seed):
    rng = random.Random(seed)
    vocab = json.loads((pair.target / "config.json").read_text())["vocab_size"]
    return [[rng.randrange(vocab - 1) for _ in range(rng.choice([1, 5, 16, 17, 60, 200]))] for _ in range(n)]


def _gate_all(pair, prompts, plain, spec, spec_engine, label):
    def score(ids):
        return score_sequences(spec_engine, [("rescore", ids[:-1], ids[-1:])])[0]

    reports = []
    for i, (p, b, s) in enumerate(zip(prompts, plain, spec)):
        rep = first_divergence_regret_gate(p, b, s, score, tol=MARGIN_TOL, reanchor=True, name=f"{label}-{i}")
        reports.append(rep)
    print(
        f"\n[{pair.name} {label}] "
        + "; ".join(
            f"#{i}: div {r.first_divergence} regret {r.first_regret:.3f} flips {r.tie_flips}"
            for i, r in enumerate(reports)
        )
    )
    for r in reports:
        r.assert_passes()


@pytest.mark.parametrize("concurrent", [False, True], ids=["bs1", "concurrent"])
def test_gpu_lossless_dflash_regret_gate(model_pair, concurrent):
    prompts = _prompts(model_pair, 10, seed=11)
    budgets = [[1, 2, B - 1, B, B + 1, 40, 64][i % 7] for i in range(len(prompts))]
    seqs = len(prompts) if concurrent else 1
    plain = greedy(gpu_engine(model_pair.target, max_num_seqs=seqs), prompts, budgets)
    spec_engine = gpu_engine(model_pair.target, model_pair.draft, max_num_seqs=seqs)
    spec = greedy(spec_engine, prompts, budgets)
    stats = spec_engine.spec_stats()
    print(
        f"\n[{model_pair.name}] tau {stats.tau:.2f} over {stats.verify_steps} verify steps, "
        f"histogram {dict(sorted(stats.accepted_hist.items()))}"
    )
    for s, b in zip(spec, budgets):
        assert len(s) == b
    spec_engine.check_integrity()
    _gate_all(model_pair, prompts, plain, spec, spec_engine, "concurrent" if concurrent else "bs1")
