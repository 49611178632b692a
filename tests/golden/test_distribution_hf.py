"""The distribution gate's HF side: golden's logits processing against HF's own warpers, and the oracle.

process_logits (temperature -> top-k -> top-p) must equal HF transformers' TemperatureLogitsWarper,
TopKLogitsWarper and TopPLogitsWarper applied in generate's order, then softmax: 200 seeded random rows
(V 2-300, every setting random) to 1e-12 with the same support, plus a row with ties at the top-k boundary
(both keep all tied tokens). And on the tiny-random fixture: samples drawn from HF itself
(golden.hf_sampling.hf_sample) gate clean against hf_conditionals, whose (cdf_below, prob) agree with the
processed logits recomputed directly.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m pytest tests/golden/test_distribution_hf.py -q -p no:cacheprovider
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from golden.distribution.gate import distribution_gate
from golden.distribution.processing import SamplingConfig, cdf_step, process_logits

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")

ROOT = Path(__file__).resolve().parents[2]


def hf_probs(x: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    warpers = [logits_process.TemperatureLogitsWarper(cfg.temperature)]
    if cfg.top_k:
        warpers.append(logits_process.TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        warpers.append(logits_process.TopPLogitsWarper(cfg.top_p))
    scores = logits_process.LogitsProcessorList(warpers)(
        torch.zeros(1, 1, dtype=torch.long), torch.tensor(x[None], dtype=torch.float64)
    )
    return torch.softmax(scores, -1)[0].numpy()


def test_processing_matches_hf_warpers():
    rng = np.random.default_rng(0)
    worst, cases = 0.0, 0
    for _ in range(200):
        vocab = int(rng.integers(2, 300))
        x = rng.normal(0.0, 3.0, vocab)
        cfg = SamplingConfig(
            float(rng.uniform(0.3, 2.0)), int(rng.integers(0, vocab + 3)), float(rng.uniform(0.05, 1.0))
        )
        hf, mine = hf_probs(x, cfg), process_logits(x, cfg)
        assert ((hf > 0) == (mine > 0)).all(), f"{cfg} V={vocab}: support {np.nonzero(hf)[0]} vs {np.nonzero(mine)[0]}"
        worst = max(worst, float(np.abs(hf - mine).max()))
        cases += 1
    assert worst < 1e-12, f"max |HF - golden| over {cases} rows: {worst:.3e}"


def test_top_k_ties_match_hf():
    x = np.array([3.0, 1.0, 2.0, 2.0, 2.0, 0.0])
    cfg = SamplingConfig(top_k=2)
    hf, mine = hf_probs(x, cfg), process_logits(x, cfg)
    assert (mine > 0).tolist() == [True, False, True, True, True, False], mine
    assert np.allclose(hf, mine, atol=1e-12), f"{hf} vs {mine}"


def test_hf_oracle_on_tiny_random():
    from golden.hf_reference import target_forward
    from golden.hf_sampling import hf_conditionals, hf_sample

    model = ROOT / "fixtures" / "tiny-random" / "target"
    cfg = SamplingConfig(temperature=0.9, top_k=50, top_p=0.95)
    samples = hf_sample(model, {"a": [1, 2, 3], "b": [7, 8]}, cfg, max_new_tokens=5, seed=3)
    golden = hf_conditionals(model, samples, cfg)
    report = distribution_gate(samples, golden, min_positions=0)
    assert report.passed and not report.impossible, str(report)
    s = samples[1]
    logits, _ = target_forward(model, s.ids, [0], torch.float32)
    row = logits[len(s.prompt_ids) + 2].double().numpy()  # predicts output[3]
    want = cdf_step(process_logits(row, cfg), s.output_ids[3])
    got = (golden[1].cdf_below[3], golden[1].prob[3])
    assert np.allclose(got, want, atol=1e-12), f"{got} vs {want}"
