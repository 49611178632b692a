"""The distribution gate end to end: the engine's speculative sampler draws from the target's own
distribution, and each classic speculative-sampling bug, put into the engine, fails the gate.

The engine (CPU fp32, the trained tiny pair, DFlash on; the real pair too when REFENGINE_TARGET_PATH /
REFENGINE_DRAFT_PATH are set) samples continuations; HF transformers gives the target's processed
conditional at every sampled position (golden.hf_sampling.hf_conditionals); golden's distribution gate
pools the randomized PIT values and tests them for uniformity (KS and chi-square at alpha 1e-3 each).
Two settings, each with the gate's powered sample size (stats.ks_sample_size(): a Kolmogorov distance of
0.05 detected with power 0.99): sampled drafts at T = 1.0, and greedy drafts at T = 0.6 with top-k 50 and
top-p 0.9.

Negative controls, each a broken accept rule swapped into the engine (refengine/runner/sampled_picks.py's
accept_speculative, or its sample_drafts), each of which must fail the gate on a smaller sample: the residual
left unnormalised, the bonus drawn from the drafter's q, a rejection falling back to p instead of the
residual, drafts drawn from the untempered drafter while accept uses the tempered q, and greedy acceptance
at T > 0.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m pytest tests/golden/test_distribution_engine.py -q -p no:cacheprovider
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from conftest import model_pairs
from golden.distribution.gate import distribution_gate
from golden.distribution.processing import SamplingConfig
from golden.distribution.records import SampleRecord
from golden.distribution.stats import ks_sample_size
from refengine.runner import sampled_picks, verify_step
from refengine.sampling.processing import sample_inverse_cdf
from refengine.spec_decode.accept_sampled import accept_speculative
from tests.adapter import cpu_engine, sampled_params
from tests.span_policies import ScriptedSpans

pytest.importorskip("transformers")

TOKENS = 32  # per continuation (ignore_eos: every one is that long)
CONTROL_PROMPTS = 40  # 1,280 positions: each bug below fails far below alpha there
PAIRS = [p for p in model_pairs() if p.name in ("tiny-trained", "real")]


def sample(pair, cfg: SamplingConfig, draft_sampling: str, prompts: int, seed: int, **engine_kw) -> list[SampleRecord]:
    rng = random.Random(seed)
    ids = [[rng.randrange(3, 400) for _ in range(rng.randint(2, 14))] for _ in range(prompts)]
    params = sampled_params(cfg, prompts, seed, TOKENS)
    engine = cpu_engine(pair.target, pair.draft, max_num_seqs=32, draft_sampling=draft_sampling, **engine_kw)
    done = engine.generate(ids, params)
    assert engine.spec_stats(done).verify_steps > 0, "the engine never speculated"
    return [SampleRecord(f"s{i}", p, r.output_ids, r.seed) for i, (p, r) in enumerate(zip(ids, done))]


def gate(pair, cfg: SamplingConfig, draft_sampling: str, prompts: int, seed: int, min_positions=None, **engine_kw):
    from golden.hf_sampling import hf_conditionals

    samples = sample(pair, cfg, draft_sampling, prompts, seed, **engine_kw)
    return distribution_gate(samples, hf_conditionals(pair.target, samples, cfg), min_positions=min_positions)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "cfg,draft_sampling",
    [(SamplingConfig(1.0), "sampled"), (SamplingConfig(0.6, top_k=50, top_p=0.9), "greedy")],
    ids=["T1-sampled-drafts", "T0.6-topk-topp-greedy-drafts"],
)
def test_engine_samples_pass_the_gate(pair, cfg, draft_sampling):
    prompts = math.ceil(ks_sample_size() / TOKENS)
    report = gate(pair, cfg, draft_sampling, prompts, seed=int(cfg.temperature * 10))
    assert report.passed, str(report)


# ---- negative controls: each a known bug, swapped in -------------------------------------------------------


def dense(q, drafts, v: int) -> torch.Tensor:
    """q, or for greedy drafts (q None) its one-hot rows."""
    return q if q is not None else torch.nn.functional.one_hot(drafts.clamp(0, v - 1), v).to(torch.float32)


def unnormalised_residual(p, q, drafts, spans, u_accept, u_final):
    """Rejection samples max(0, p - q) by inverse CDF without dividing by its mass."""
    m, picks = accept_speculative(p, q, drafts, spans, u_accept, u_final)
    rows = torch.arange(p.shape[0])
    rejected = m < spans - 1
    if rejected.any():
        qm = dense(q, drafts, p.shape[-1])[rows, m.clamp(max=drafts.shape[1] - 1)]
        r = (p[rows, m] - qm).clamp(min=0)
        cdf = r.double().cumsum(-1)  # [N, V], total < 1: u past it clamps to the last token
        tok = torch.searchsorted(cdf, u_final[rows, m].double()[:, None], right=True).squeeze(-1)
        tok = tok.clamp(max=p.shape[-1] - 1)
        cols = torch.arange(p.shape[1])[None, :]
        picks = torch.where(rejected[:, None] & (cols >= m[:, None]), tok[:, None], picks)
    return m, picks


DRAFTER_ROWS: dict[str, torch.Tensor] = {}  # bonus-from-q: the drafter's q of every block row, this step


def keep_drafter_rows(target, reqs, starts, spans, hidden, drafts, q):
    DRAFTER_ROWS["q"] = q  # [N, B-1, V]: verify_picks hands accept only the rows its spans use
    return ORIGINAL_VERIFY_PICKS(target, reqs, starts, spans, hidden, drafts, q)


def bonus_from_q(p, q, drafts, spans, u_accept, u_final):
    """After a full accept the bonus comes from the drafter's q at the bonus position (spans of 2: its block
    has that row) instead of the target's p."""
    m, picks = accept_speculative(p, q, drafts, spans, u_accept, u_final)
    rows, full_q = torch.arange(p.shape[0]), DRAFTER_ROWS["q"]
    full = (m == spans - 1) & (spans > 1) & (spans - 1 < full_q.shape[1])
    if full.any():
        tok = sample_inverse_cdf(full_q[rows, (spans - 1).clamp(max=full_q.shape[1] - 1)], u_final[rows, m])
        picks = torch.where(full[:, None] & (torch.arange(p.shape[1])[None, :] >= m[:, None]), tok[:, None], picks)
    return m, picks


def rejection_to_p(p, q, drafts, spans, u_accept, u_final):
    """A rejection draws from p_m instead of the residual (q set to zero makes the residual p itself)."""
    m, _ = accept_speculative(p, q, drafts, spans, u_accept, u_final)
    rows = torch.arange(p.shape[0])
    tok = sample_inverse_cdf(p[rows, m], u_final[rows, m])  # may even redraw the rejected draft
    picks = torch.cat([drafts, drafts[:, :1]], dim=1)
    picks = torch.where(torch.arange(p.shape[1])[None, :] >= m[:, None], tok[:, None], picks)
    return m, picks


def greedy_acceptance(p, q, drafts, spans, u_accept, u_final):
    """The temperature-0 rule at T > 0: accept iff the draft is p's argmax; the stop token from p."""
    n, s, _ = p.shape
    rows = torch.arange(n)
    ok = (drafts == p[:, :-1].argmax(-1)) & (torch.arange(s - 1)[None, :] < (spans - 1)[:, None])
    m = ok.long().cumprod(-1).sum(-1)
    tok = sample_inverse_cdf(p[rows, m], u_final[rows, m])
    picks = torch.cat([drafts, drafts[:, :1]], dim=1)
    return m, torch.where(torch.arange(s)[None, :] >= m[:, None], tok[:, None], picks)


def untempered_drafts(logits, reqs, starts, spans):
    """Drafts drawn from the drafter at temperature 1, while accept is handed the tempered q."""
    one = [replace(r, params=replace(r.params, temperature=1.0)) for r in reqs]
    drafts, _ = ORIGINAL_SAMPLE_DRAFTS(logits, one, starts, spans)
    _, q = ORIGINAL_SAMPLE_DRAFTS(logits, reqs, starts, spans)
    return drafts, q


ORIGINAL_SAMPLE_DRAFTS = sampled_picks.sample_drafts
ORIGINAL_VERIFY_PICKS = sampled_picks.verify_picks
# label: (module, name, the broken function, a setting where the bug moves real mass: temperature, drafts,
# verify spans (0: the fixed policy's))
CONTROLS = {
    "unnormalised-residual": (sampled_picks, "accept_speculative", unnormalised_residual, 1.0, "sampled", 0),
    "bonus-from-q": (sampled_picks, "accept_speculative", bonus_from_q, 1.0, "sampled", 2),
    "rejection-to-p": (sampled_picks, "accept_speculative", rejection_to_p, 0.6, "greedy", 0),
    "greedy-acceptance": (sampled_picks, "accept_speculative", greedy_acceptance, 1.0, "sampled", 0),
    "untempered-drafter": (verify_step, "sample_drafts", untempered_drafts, 0.6, "sampled", 0),
}


@pytest.mark.parametrize("label", CONTROLS)
def test_negative_control_fails_the_gate(trained_pair, monkeypatch, label):
    module, name, broken, temperature, draft_sampling, span = CONTROLS[label]
    monkeypatch.setattr(module, name, broken)
    kw = {}
    if span:
        monkeypatch.setattr(verify_step, "verify_picks", keep_drafter_rows)
        kw["span_policy"] = ScriptedSpans(16, lambda step, ids, rem: [span] * len(ids))
    cfg = SamplingConfig(temperature)
    report = gate(trained_pair, cfg, draft_sampling, CONTROL_PROMPTS, seed=7, min_positions=0, **kw)
    assert not report.passed, f"{label}: the broken rule passed the gate: {report}"
