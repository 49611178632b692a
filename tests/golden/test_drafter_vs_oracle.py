"""Differential test: the engine's batched DFlash drafter (dense ops once over N x B rows, per-request
non-causal attention over cached context K/V) against golden's dense one-request oracle written straight
from the spec, in fp32, for many random contexts, lengths and batch compositions, with context arriving in
chunks across propose calls as it does after verify steps (and projected in small chunks on odd seeds).

Run: pytest tests/golden/test_drafter_vs_oracle.py
"""
from __future__ import annotations

import random

import pytest
import torch

import refengine.spec_decode.lane as lane_module
from golden.oracle_dflash import OracleDFlash
from refengine.spec_decode import DraftItem
from tests.adapter import cpu_engine

LOGIT_ATOL = 1e-3  # fp32: observed max |delta| is ~1e-5 (reduction order only)


@pytest.mark.parametrize("seed", range(6))
def test_batched_drafter_matches_dense_oracle(model_pair, seed, monkeypatch):
    # odd seeds project pending context in 5-row chunks, so chunk boundaries fall inside and across requests
    monkeypatch.setattr(lane_module, "FLUSH_ROWS", 5 if seed % 2 else lane_module.FLUSH_ROWS)
    engine = cpu_engine(model_pair.target, model_pair.draft)
    lane, drafter = engine.proposer, engine.drafter
    oracle = OracleDFlash(model_pair.draft, model_pair.target, dtype=torch.float32)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_req = rng.choice([1, 2, 3, 5, 8])
    b = drafter.cfg.block_size
    lengths = [rng.choice([1, 2, 15, 16, 17, rng.randrange(1, 120)]) for _ in range(n_req)]
    feats = [torch.randn(n, drafter.feature_width, generator=gen) for n in lengths]
    for r, n in enumerate(lengths):
        lane.start_request(r, n + b)
    # context arrives in up to three chunks; the lane projects pending rows lazily at propose time
    done = [0] * n_req
    for round_ in range(3):
        for r, n in enumerate(lengths):
            upto = n if round_ == 2 else min(n, done[r] + rng.randrange(0, n + 1))
            if upto > done[r]:
                lane.append_pending_context(r, feats[r][done[r]:upto], done[r])
                done[r] = upto
        ready = [r for r in range(n_req) if done[r] > 0]
        if not ready:
            continue
        current = {r: rng.randrange(engine.target.cfg.vocab_size) for r in ready}
        items = [DraftItem(r, current[r], done[r], b) for r in ready]
        got = lane.propose_logits(items)  # [N, B-1, V]
        for i, r in enumerate(ready):
            want = oracle.draft_logits(feats[r][:done[r]], current[r], done[r])
            delta = (got[i] - want).abs()
            assert delta.max().item() < LOGIT_ATOL, (
                f"request {r} (context {done[r]}, batch {len(ready)}): max |delta| {delta.max().item():.3e}, "
                f"mean {delta.mean().item():.3e}, "
                f"first row over tol {int((delta.amax(-1) >= LOGIT_ATOL).nonzero()[0])}")
            assert got[i].argmax(-1).tolist() == want.argmax(-1).tolist()
