"""The distribution gate (golden/distribution/gate.py and stats.py) on synthetic engines.

A seeded Markov "target" (V = 40, each row processed with temperature / top-k / top-p) plays the model.
Samples drawn exactly from it pass (fixed seeds: the false-alarm rate is <= 2e-3 per run, and these seeds
are known to pass); a reference speculative sampler (speculative_step with drafts from a different
drafter) passes too; engines off by a total-variation error of 0.05 or 0.1, and a speculative sampler whose
rejection falls back to p, fail at the computed sample count (stats.ks_sample_size() = 5119 positions).
Also: the KS and chi-square p-values against textbook values, the sample-size figure, impossible tokens,
coverage errors and the JSONL round trip.

    PYTHONPATH=. python -m pytest tests/golden/test_distribution_gate.py -q -p no:cacheprovider
"""

from __future__ import annotations

import numpy as np
import pytest

from golden.distribution.gate import distribution_gate
from golden.distribution.processing import SamplingConfig, cdf_step, process_logits, rank_order
from golden.distribution.records import (
    ConditionalRecord,
    SampleRecord,
    read_conditionals_jsonl,
    read_samples_jsonl,
    write_distribution_jsonl,
)
from golden.distribution.speculative import sample_inverse_cdf, speculative_step
from golden.distribution.stats import (
    chi2_sf,
    kolmogorov_quantile,
    kolmogorov_sf,
    ks_pvalue,
    ks_sample_size,
    ks_statistic,
)
from golden.errors import CoverageError, RecordError

VOCAB, LENGTH = 40, 32
N_NEEDED = ks_sample_size()
RECORDS = -(-N_NEEDED // LENGTH)  # 160 records x 32 positions >= 5119
CFG = SamplingConfig(temperature=0.8, top_k=30, top_p=0.95)


class Markov:
    """p(next | previous token), processed with `cfg`; the prompt's last token starts the chain."""

    def __init__(self, seed: int, cfg: SamplingConfig, base: Markov | None = None, noise: float = 1.0):
        self.logits = np.random.default_rng(seed).normal(0.0, 2.0, (VOCAB, VOCAB))
        if base is not None:  # a drafter: the target's logits plus noise
            self.logits = base.logits + noise * self.logits / 2.0
        self.rows = np.stack([process_logits(row, cfg) for row in self.logits])

    def p(self, prev: int) -> np.ndarray:
        return self.rows[prev]


def sample_plain(model: Markov, rng, prompt: list[int], distort=None) -> list[int]:
    out, prev = [], prompt[-1]
    for _ in range(LENGTH):
        p = model.p(prev) if distort is None else distort(model.p(prev))
        prev = sample_inverse_cdf(p, rng.random())
        out.append(prev)
    return out


def sample_speculative(target: Markov, drafter: Markov, rng, prompt: list[int], k: int = 3, fallback_to_p=False):
    out, prev = [], prompt[-1]
    while len(out) < LENGTH:
        drafts, q_rows, p_rows, d = [], [], [], prev
        for _ in range(k):
            q_rows.append(drafter.p(d))
            p_rows.append(target.p(d))
            d = sample_inverse_cdf(q_rows[-1], rng.random())
            drafts.append(d)
        p_rows.append(target.p(d))
        if fallback_to_p:  # the bug: a rejection samples p instead of norm(max(0, p - q))
            committed = []
            for j, dj in enumerate(drafts):
                if rng.random() < min(1.0, p_rows[j][dj] / q_rows[j][dj]):
                    committed.append(dj)
                    continue
                committed.append(sample_inverse_cdf(p_rows[j], rng.random()))
                break
            else:
                committed.append(sample_inverse_cdf(p_rows[k], rng.random()))
        else:
            committed = speculative_step(np.stack(p_rows), np.stack(q_rows), drafts, list(rng.random(k)), rng.random())
        out += committed
        prev = out[-1]
    return out[:LENGTH]


def make_records(target: Markov, seed: int, sampler) -> tuple[list[SampleRecord], list[ConditionalRecord]]:
    rng = np.random.default_rng(seed)
    engine, golden = [], []
    for r in range(RECORDS):
        prompt = [int(t) for t in rng.integers(0, VOCAB, 3)]
        output = sampler(rng, prompt)
        name = f"s{r:03d}"
        engine.append(SampleRecord(name=name, prompt_ids=prompt, output_ids=output, seed=seed * 1000 + r))
        cdf_below, prob, prev = [], [], prompt[-1]
        for x in output:
            c, px = cdf_step(target.p(prev), x)
            cdf_below.append(c)
            prob.append(px)
            prev = x
        golden.append(ConditionalRecord(name, prompt, output, CFG.temperature, CFG.top_k, CFG.top_p, cdf_below, prob))
    return engine, golden


def sharpen(tv: float):
    """An engine off by exactly `tv` in total variation at every position: tv of mass taken from the least
    likely tokens of the support and put on the most likely one (the PIT's Kolmogorov distance is then tv)."""

    def distort(p: np.ndarray) -> np.ndarray:
        q, take = p.copy(), tv
        for i in rank_order(p)[::-1]:
            t = min(take, q[i])
            q[i] -= t
            take -= t
            if take <= 0:
                break
        q[rank_order(p)[0]] += tv - take
        return q

    return distort


def flatten(tv: float):
    """The reverse: tv of mass taken from the most likely token, spread over the support in proportion."""

    def distort(p: np.ndarray) -> np.ndarray:
        top = rank_order(p)[0]
        rest = p.copy()
        rest[top] = 0.0
        take = min(tv, p[top])
        q = p + take * rest / rest.sum()
        q[top] -= take
        return q

    return distort


def bump_top(tv: float):
    """An engine that over-samples the most likely token: TV `tv` (a one-token bump)."""

    def distort(p: np.ndarray) -> np.ndarray:
        top = int(np.argmax(p))
        e = min(1.0, tv / max(1e-9, 1.0 - p[top]))
        return (1 - e) * p + e * np.eye(VOCAB)[top]

    return distort


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_exact_samples_pass(seed):
    target = Markov(seed, CFG)
    engine, golden = make_records(target, seed, lambda rng, prompt: sample_plain(target, rng, prompt))
    report = distribution_gate(engine, golden)
    print(report)
    assert report.uniformity.n >= N_NEEDED
    assert report.passed, str(report)


def test_reference_speculative_sampler_passes():
    target = Markov(4, CFG)
    drafter = Markov(5, SamplingConfig(temperature=1.3), base=target)
    engine, golden = make_records(target, 4, lambda rng, prompt: sample_speculative(target, drafter, rng, prompt))
    report = distribution_gate(engine, golden)
    print(report)
    assert report.passed, str(report)


@pytest.mark.parametrize(
    "label,distort", [("sharpen 0.05", sharpen(0.05)), ("top bump 0.1", bump_top(0.1)), ("flatten 0.07", flatten(0.07))]
)
@pytest.mark.parametrize("seed", [6, 7])
def test_tv_error_fails(seed, label, distort):
    target = Markov(seed, CFG)
    engine, golden = make_records(target, seed, lambda rng, prompt: sample_plain(target, rng, prompt, distort))
    report = distribution_gate(engine, golden)
    print(label, report)
    assert not report.passed, f"{label}: a TV error was not detected: {report}"
    assert report.uniformity.ks_p < 1e-3 or report.uniformity.chi2_p < 1e-3, str(report)


def test_speculative_rejection_to_p_fails():
    target = Markov(8, CFG)
    drafter = Markov(9, SamplingConfig(temperature=1.3), base=target)
    engine, golden = make_records(
        target, 8, lambda rng, prompt: sample_speculative(target, drafter, rng, prompt, fallback_to_p=True)
    )
    report = distribution_gate(engine, golden)
    print(report)
    assert not report.passed, str(report)


def test_impossible_token_fails():
    target = Markov(10, CFG)
    engine, golden = make_records(target, 10, lambda rng, prompt: sample_plain(target, rng, prompt))
    g = golden[0]
    outside = int(np.nonzero(target.p(g.prompt_ids[-1]) == 0)[0][0])  # top-k 30 of 40: some row entries are 0
    output = [outside, *g.output_ids[1:]]
    golden[0] = ConditionalRecord(
        g.name, g.prompt_ids, output, 0.8, 30, 0.95, [0.5, *g.cdf_below[1:]], [0.0, *g.prob[1:]]
    )
    engine[0] = SampleRecord(g.name, g.prompt_ids, output, engine[0].seed)
    report = distribution_gate(engine, golden)
    assert not report.passed and len(report.impossible) == 1, str(report)
    assert report.impossible[0].token == outside, str(report.impossible[0])


def test_coverage_errors():
    target = Markov(11, CFG)
    engine, golden = make_records(target, 11, lambda rng, prompt: sample_plain(target, rng, prompt))
    with pytest.raises(CoverageError, match="missing 1"):
        distribution_gate(engine[1:], golden)
    other = SampleRecord(engine[0].name, engine[0].prompt_ids, [*engine[0].output_ids[:-1], 0], 1)
    if other.output_ids != engine[0].output_ids:
        with pytest.raises(CoverageError, match="different prompt"):
            distribution_gate([other, *engine[1:]], golden)
    with pytest.raises(CoverageError, match="fewer than the 5119"):
        distribution_gate(engine[:10], golden[:10])
    assert distribution_gate(engine[:10], golden[:10], min_positions=0).uniformity.n == 320


def test_roundtrip(tmp_path):
    target = Markov(12, CFG)
    engine, golden = make_records(target, 12, lambda rng, prompt: sample_plain(target, rng, prompt))
    assert read_samples_jsonl(write_distribution_jsonl(tmp_path / "e.jsonl", engine)) == engine
    back = read_conditionals_jsonl(write_distribution_jsonl(tmp_path / "g.jsonl.gz", golden))
    assert [g.output_ids for g in back] == [g.output_ids for g in golden]
    assert max(abs(a - b) for g, h in zip(back, golden) for a, b in zip(g.prob, h.prob)) < 1e-11
    (tmp_path / "bad.jsonl").write_text('{"name": "x", "prompt_ids": [1], "output_ids": [2]}\n')
    with pytest.raises(RecordError, match="bad.jsonl:1"):
        read_samples_jsonl(tmp_path / "bad.jsonl")


def test_statistics_against_textbook_values():
    assert abs(kolmogorov_sf(1.3581) - 0.05) < 1e-4, kolmogorov_sf(1.3581)
    assert abs(kolmogorov_sf(1.6276) - 0.01) < 1e-4, kolmogorov_sf(1.6276)
    assert abs(kolmogorov_quantile(1e-3) - 1.9495) < 1e-3, kolmogorov_quantile(1e-3)
    assert abs(chi2_sf(30.144, 19) - 0.05) < 1e-4, chi2_sf(30.144, 19)
    assert abs(chi2_sf(43.820, 19) - 0.001) < 1e-5, chi2_sf(43.820, 19)
    assert abs(chi2_sf(3.841, 1) - 0.05) < 1e-4, chi2_sf(3.841, 1)
    assert ks_statistic([0.5]) == 0.5 and ks_statistic([0.25, 0.75]) == 0.25
    assert ks_pvalue(0.01, 5000) > 0.5 and ks_pvalue(0.05, 5000) < 1e-9
    assert ks_sample_size() == 5119, ks_sample_size()  # ((1.9495 + 1.6276) / 0.05)^2 = 5118.2


def test_cdf_step_rank_order():
    assert cdf_step(np.array([0.2, 0.5, 0.3]), 2) == (0.5, 0.3)  # ranked after 0.5, before 0.2
    assert cdf_step(np.array([0.2, 0.5, 0.3]), 0) == (0.8, 0.2)
    assert cdf_step(np.array([0.4, 0.2, 0.4]), 2) == (0.4, 0.4)  # a tie: the lower id ranks first
    assert cdf_step(np.array([0.4, 0.2, 0.4]), 0) == (0.0, 0.4)
    assert rank_order(np.array([0.4, 0.2, 0.4])).tolist() == [0, 2, 1]
