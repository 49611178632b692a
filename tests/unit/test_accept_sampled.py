"""The engine's sampling pieces against golden's float64 references, on the same uniforms:
accept_speculative (refengine/spec_decode/accept_sampled.py) commits exactly golden's speculative_step tokens
for 600 random (p, q, drafts, uniforms) cases, sampled and greedy (one-hot) drafts, spans 1..S in one batch;
its picks give back m under accept_greedy; processed_probs equals golden's process_logits on random rows and
every top-k / top-p setting, ties included; sample_inverse_cdf equals golden's; the random streams are
deterministic, distinct by purpose, position and seed, uniform, and the batched rows equal each request's own.

    PYTHONPATH=. python -m pytest tests/unit/test_accept_sampled.py -q -p no:cacheprovider
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from golden.distribution.processing import SamplingConfig, process_logits
from golden.distribution.speculative import sample_inverse_cdf as golden_inverse_cdf
from golden.distribution.speculative import speculative_step
from refengine.request import SamplingParams
from refengine.sampling.processing import processed_probs, sample_inverse_cdf
from refengine.sampling.streams import ACCEPT, DRAFT, FINAL, uniform_rows, uniforms
from refengine.spec_decode.accept import accept_greedy
from refengine.spec_decode.accept_sampled import accept_speculative


def random_dist(rng: np.random.Generator, v: int, sparse: bool) -> np.ndarray:
    x = rng.dirichlet(np.full(v, 0.5))
    if sparse:  # zeros, as top-k / top-p leave
        x[rng.random(v) < 0.4] = 0.0
        x[rng.integers(v)] += 0.1
        x /= x.sum()
    return x


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_accept_equals_golden_step(greedy_drafts):
    rng = np.random.default_rng(7 + greedy_drafts)
    n, s, v = 300, 5, 6
    p = np.stack([[random_dist(rng, v, rng.random() < 0.5) for _ in range(s)] for _ in range(n)])
    q = np.stack([[random_dist(rng, v, rng.random() < 0.5) for _ in range(s - 1)] for _ in range(n)])
    spans = rng.integers(1, s + 1, n)
    drafts = np.zeros((n, s - 1), dtype=np.int64)
    for i in range(n):
        for j in range(s - 1):
            drafts[i, j] = np.argmax(q[i, j]) if greedy_drafts else rng.choice(v, p=q[i, j])
    if greedy_drafts:
        q = np.eye(v)[drafts]
    u_acc, u_fin = rng.random((n, s - 1)), rng.random((n, s))
    m, picks = accept_speculative(
        torch.from_numpy(p),
        None if greedy_drafts else torch.from_numpy(q),
        torch.from_numpy(drafts),
        torch.from_numpy(spans),
        torch.from_numpy(u_acc),
        torch.from_numpy(u_fin),
    )
    bad = []
    for i in range(n):
        k = spans[i] - 1
        # golden draws its one sample with one uniform: the row the engine's draw lands on decides which
        mi = int(m[i])
        want = speculative_step(p[i, : k + 1], q[i, :k], drafts[i, :k], u_acc[i, :k], u_fin[i, mi])
        got = picks[i, : mi + 1].tolist()
        if got != want or accept_greedy(drafts[i, :k].tolist(), picks[i, : k + 1].tolist()) != mi:
            bad.append((i, k, got, want))
    assert not bad, f"{len(bad)}/{n} steps differ from golden's; first (i, k, engine, golden): {bad[:3]}"


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (5, 0.5), (1, 1.0), (0, 0.01)])
def test_processing_equals_golden(top_k, top_p):
    rng = np.random.default_rng(top_k * 100 + int(top_p * 10))
    rows = rng.normal(0, 2, (40, 50))
    rows[0, :4] = rows[0].max() + 1  # a tie at the top
    rows[1, [3, 9]] = np.sort(rows[1])[-3]  # ties at the top-k boundary
    temps = rng.uniform(0.3, 2.0, 40)
    params = [SamplingParams(temperature=t, top_k=top_k, top_p=top_p) for t in temps]
    got = processed_probs(torch.from_numpy(rows), params).double().numpy()
    want = np.stack([process_logits(r, SamplingConfig(t, top_k, top_p)) for r, t in zip(rows, temps)])
    err = np.abs(got - want).max()
    support = ((got > 0) != (want > 0)).sum()
    assert err < 1e-6 and support == 0, f"max |delta| {err:.3g}, {support} tokens differ in support"


def test_inverse_cdf_equals_golden():
    rng = np.random.default_rng(3)
    probs = np.stack([random_dist(rng, 20, True) for _ in range(200)])
    u = rng.random(200)
    got = sample_inverse_cdf(torch.from_numpy(probs), torch.from_numpy(u)).tolist()
    want = [golden_inverse_cdf(pr, x) for pr, x in zip(probs, u)]
    diff = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    first = [(i, got[i], want[i]) for i in diff[:3]]
    assert not diff, f"{len(diff)} draws differ; first (row, engine, golden): {first}"


def test_streams_are_keyed_and_uniform():
    a = uniforms(5, range(1000), FINAL)
    assert np.array_equal(a, uniforms(5, range(1000), FINAL))
    assert np.array_equal(a[10:20], uniforms(5, range(10, 20), FINAL)), "a uniform depends on more than its key"
    for other in (uniforms(6, range(1000), FINAL), uniforms(5, range(1000), DRAFT), uniforms(5, range(1000), ACCEPT)):
        assert np.mean(a == other) < 0.01
    big = uniforms(11, range(200_000), DRAFT)
    assert big.min() >= 0.0 and big.max() < 1.0
    counts = np.histogram(big, bins=20, range=(0, 1))[0]
    chi2 = ((counts - 10_000) ** 2 / 10_000).sum()
    assert chi2 < 50, f"chi-square {chi2:.1f} on 19 degrees of freedom: the stream is not uniform"


def test_stream_rows_equal_each_request_alone():
    seeds, starts = [3, 2**63 - 1, 0, 12345], [0, 7, 100, 2**40]
    rows = uniform_rows(seeds, starts, 5, ACCEPT)
    for i, (seed, start) in enumerate(zip(seeds, starts)):
        alone = uniforms(seed, range(start + 1, start + 6), ACCEPT)
        assert np.array_equal(rows[i], alone), f"request {i}: {rows[i]} vs {alone}"
