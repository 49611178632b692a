"""Differential test: the engine's batched DFlash drafter (dense ops once over N x B rows, per-request
non-causal attention over cached context K/V) against golden's dense one-request oracle written straight
from the spec, in fp32, for many random contexts, lengths and batch compositions, with context arriving in
chunks across propose calls as it does after verify steps (and projected in small chunks on odd seeds).
Also on an untied random pair built on the fly (lm_head != embedding), where a drafter projecting with the
embedding instead of the target's lm_head fails.
Pairs: every model pair plus tiny-random-gqa2, whose target has 2 KV heads and whose drafter's MASK id is
517 of a 1024 vocabulary (the real z-lab drafter uses 151669 of 151936, not vocab_size - 1).

Run: pytest tests/golden/test_drafter_vs_oracle.py
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import refengine.spec_decode.lane_draft as lane_module  # the lane's draft forward reads FLUSH_ROWS
from golden.oracle_dflash import OracleDFlash
from refengine.spec_decode import DraftItem
from tests.adapter import break_drafter_head_is_the_embedding, break_mask_token_is_last_vocab_row, cpu_engine

LOGIT_ATOL = 1e-3  # fp32: observed max |delta| is ~1e-5 (reduction order only)


def _compare(pair, seed, monkeypatch, breakage=None) -> list[str]:
    """Problems (with numbers) of the engine's batched drafter against the dense oracle for one seed."""
    # odd seeds project pending context in 5-row chunks, so chunk boundaries fall inside and across requests
    monkeypatch.setattr(lane_module, "FLUSH_ROWS", 5 if seed % 2 else lane_module.FLUSH_ROWS)
    engine = cpu_engine(pair.target, pair.draft)
    if breakage is not None:
        breakage(engine)
    lane, drafter = engine.proposer, engine.drafter
    oracle = OracleDFlash(pair.draft, pair.target, dtype=torch.float32)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_req = rng.choice([1, 2, 3, 5, 8])
    b = drafter.cfg.block_size
    lengths = [rng.choice([1, 2, 15, 16, 17, rng.randrange(1, 120)]) for _ in range(n_req)]
    feats = [torch.randn(n, drafter.feature_width, generator=gen) for n in lengths]
    for r, n in enumerate(lengths):
        lane.start_request(r, n + b)
        engine.pool.admit(r, n)  # the feature store's rows are the target's KV slots of the request
        engine.pool.extend(r, n)
    # context arrives in up to three chunks; the lane projects pending rows lazily at propose time
    done, problems = [0] * n_req, []
    for round_ in range(3):
        for r, n in enumerate(lengths):
            upto = n if round_ == 2 else min(n, done[r] + rng.randrange(0, n + 1))
            if upto > done[r]:
                lane.store.put(r, done[r], feats[r][done[r] : upto])
                lane.append_pending_context(r, done[r], upto - done[r])
                done[r] = upto
        ready = [r for r in range(n_req) if done[r] > 0]
        if not ready:
            continue
        current = {r: rng.randrange(engine.target.cfg.vocab_size) for r in ready}
        items = [DraftItem(r, current[r], done[r], b) for r in ready]
        got = lane.propose_logits(items)  # [N, B-1, V]
        for i, r in enumerate(ready):
            want = oracle.draft_logits(feats[r][: done[r]], current[r], done[r])
            delta = (got[i] - want).abs()
            if delta.max().item() >= LOGIT_ATOL or got[i].argmax(-1).tolist() != want.argmax(-1).tolist():
                problems.append(
                    f"request {r} (context {done[r]}, batch {len(ready)}): max |delta| {delta.max().item():.3e}, "
                    f"mean {delta.mean().item():.3e}, first row over tol "
                    f"{int((delta.amax(-1) >= LOGIT_ATOL).nonzero()[0]) if delta.max() >= LOGIT_ATOL else None}"
                )
    return problems


@pytest.mark.parametrize("seed", range(6))
def test_batched_drafter_matches_dense_oracle(differential_pair, seed, monkeypatch):
    problems = _compare(differential_pair, seed, monkeypatch)
    assert not problems, "\n".join(problems)


def test_gqa_pair_covers_the_blind_spots():
    from conftest import gqa_pair

    pair = gqa_pair()
    assert pair is not None, "fixtures/tiny-random-gqa2 is missing (python -m fixtures.build.random_pair ...)"
    target = json.loads((pair.target / "config.json").read_text())
    draft = json.loads((pair.draft / "config.json").read_text())
    mask = draft["dflash_config"]["mask_token_id"]
    assert target["num_key_value_heads"] == 2 and target["head_dim"] == 128
    assert 0 < mask < target["vocab_size"] - 1, f"MASK id {mask} should sit inside the vocabulary"


def test_a_hard_coded_mask_id_fails_only_on_the_gqa_pair(differential_pair, monkeypatch):
    """A drafter that fills its block with vocab_size - 1 instead of the configured MASK id: invisible on
    pairs whose MASK is the last row, caught on tiny-random-gqa2."""
    cfg = json.loads((differential_pair.draft / "config.json").read_text())
    vocab = json.loads((differential_pair.target / "config.json").read_text())["vocab_size"]
    problems = _compare(differential_pair, 0, monkeypatch, break_mask_token_is_last_vocab_row)
    print("\n".join(problems))
    if cfg["dflash_config"]["mask_token_id"] == vocab - 1:
        assert not problems, "the breakage should be a no-op where MASK is the last row"
    else:
        assert problems, "the differential test let a hard-coded MASK id through"


def test_untied_pair_and_a_swapped_head(tmp_path, monkeypatch):
    """Every stored pair ties lm_head to the embedding, hiding a drafter that uses the wrong one."""
    from types import SimpleNamespace

    from fixtures.build.random_pair import build_random_pair

    target, draft = build_random_pair(tmp_path / "untied", seed=5, tied=False)
    pair = SimpleNamespace(target=target, draft=draft)
    assert not _compare(pair, 1, monkeypatch)
    problems = _compare(pair, 1, monkeypatch, break_drafter_head_is_the_embedding)
    print("\n".join(problems))
    assert problems, "the differential test let a drafter with the wrong head through"
