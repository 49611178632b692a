"""Tests of the HF oracle helpers and the dense DFlash oracle (golden/hf_reference.py, golden/oracle_dflash.py).

Checks: tap features are HF's hidden_states[L+1] (pre-norm even for the last layer); the oracle drafter
agrees with an independent assembly from HF's own Qwen3 pieces in the z-lab layout (context and block
concatenated before k/v projection, HF RoPE, SDPA non-causal); it is a pure function of (context
features, positions, block); sharded and untied targets load; oracle_spec_generate equals plain HF greedy
exactly in fp32 (the lossless property) with the real drafter and with forced-acceptance test drafters
(oracle: tau = span; garbage: tau = 1; noisy: any pattern), truncates at EOS and at the budget, and feeds
the drafter exactly the committed prefix's features. `slow`: regen live vs the stored goldens, and the
spec loop on every stored prompt.

    HF_HUB_OFFLINE=1 python -m pytest tests/golden/test_oracle_dflash.py -q            # fast ones
    HF_HUB_OFFLINE=1 python -m pytest tests/golden/test_oracle_dflash.py -q -m slow    # the slow ones
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from golden import hf_reference, pairs, regen
from golden.oracle_dflash import OracleDFlash, oracle_spec_generate, read_safetensors

PAIR = pairs.pair_spec("tiny-random")
TARGET, DRAFT = PAIR.target_dir, PAIR.draft_dir


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1023) for _ in range(n)]


@pytest.fixture(scope="module")
def oracle() -> OracleDFlash:
    return OracleDFlash(DRAFT, TARGET)


@pytest.fixture(scope="module")
def context(oracle) -> tuple[list[int], torch.Tensor]:
    ids = rand_ids(37, seed=1)
    return ids, hf_reference.target_features(TARGET, ids, oracle.geom.target_layer_ids)  # [37, 2*256]


# ---------------------------------------------------------------- target features


def test_target_features_equal_hf_hidden_states():
    ids = rand_ids(20, seed=2)
    model = hf_reference.load_model(TARGET)
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # L+1 entries
    feats = hf_reference.target_features(TARGET, ids, [1, 2])
    assert feats.shape == (20, 2 * 256)
    torch.testing.assert_close(feats, torch.cat([hs[2][0], hs[3][0]], dim=-1), rtol=0, atol=0)
    # the last layer's tap is its output *before* the final norm, which HF's hidden_states[-1] is not
    last = hf_reference.target_features(TARGET, ids, [3])
    torch.testing.assert_close(model.model.norm(last), hs[4][0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        hf_reference.target_features(TARGET, ids, [4])


# ---------------------------------------------------------------- the drafter


def zlab_layout_draft_logits(ctx_feat: torch.Tensor, current: int, start: int) -> torch.Tensor:
    """The drafter rebuilt from HF's Qwen3 pieces the way z-lab's module lays it out: the context rows
    are concatenated with the normed block rows *before* k/v projection, RoPE is HF's over positions
    0..start+B-1 (queries take the last B), attention is SDPA with is_causal=False."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
        repeat_kv,
    )

    cfg = AutoConfig.from_pretrained(DRAFT, local_files_only=True)
    w = read_safetensors(DRAFT)
    embed = read_safetensors(TARGET, ["model.embed_tokens.weight"])["model.embed_tokens.weight"].float()
    nh, nkv, d, bsz = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size
    mask_id = cfg.dflash_config["mask_token_id"]

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        layer = Qwen3RMSNorm(x.shape[-1], cfg.rms_norm_eps)
        layer.weight.data = w[name].float()
        return layer(x)

    def lin(name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w[name].float())

    n = ctx_feat.shape[0]
    target_hidden = norm("hidden_norm.weight", lin("fc.weight", ctx_feat))[None]  # [1, n, H]
    x = embed[torch.tensor([[current] + [mask_id] * (bsz - 1)])]  # [1, B, H]
    cos, sin = Qwen3RotaryEmbedding(cfg)(x, torch.arange(start + bsz)[None])  # [1, n+B, d]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        u = norm(p + "input_layernorm.weight", x)
        q = norm(p + "self_attn.q_norm.weight", lin(p + "self_attn.q_proj.weight", u).view(1, bsz, nh, d))
        kv_in = torch.cat([target_hidden, u], dim=1)  # [1, n+B, H]
        k = norm(p + "self_attn.k_norm.weight", lin(p + "self_attn.k_proj.weight", kv_in).view(1, n + bsz, nkv, d))
        v = lin(p + "self_attn.v_proj.weight", kv_in).view(1, n + bsz, nkv, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos[:, -bsz:], sin[:, -bsz:])
        _, k = apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)
        attn = F.scaled_dot_product_attention(q, repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv), is_causal=False)
        x = x + lin(p + "self_attn.o_proj.weight", attn.transpose(1, 2).reshape(1, bsz, nh * d))
        h = norm(p + "post_attention_layernorm.weight", x)
        gated = F.silu(lin(p + "mlp.gate_proj.weight", h)) * lin(p + "mlp.up_proj.weight", h)
        x = x + lin(p + "mlp.down_proj.weight", gated)
    return norm("norm.weight", x)[0, 1:] @ embed.T  # [B-1, V], tied head


@pytest.mark.parametrize("n_ctx", [1, 37])
def test_oracle_matches_zlab_layout_from_hf_pieces(oracle, context, n_ctx):
    _, feats = context
    ours = oracle.draft_logits(feats[:n_ctx], current_token=77, start=n_ctx)
    assert ours.shape == (15, 1024)
    with torch.no_grad():
        ref = zlab_layout_draft_logits(feats[:n_ctx], 77, n_ctx)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_drafter_is_a_pure_function(oracle, context):
    _, feats = context
    first = oracle.draft_logits(feats, 5, 37)
    oracle.draft_logits(feats[:10] * 3.0, 9, 10)  # an unrelated call in between leaves no trace
    torch.testing.assert_close(oracle.draft_logits(feats, 5, 37), first, rtol=0, atol=0)
    assert oracle.draft(feats, 5, 37) == first.argmax(-1).tolist()
    # the context is read: perturbing one context row's features changes the logits
    bumped = feats.clone()
    bumped[3] += 1.0
    assert (oracle.draft_logits(bumped, 5, 37) - first).abs().max() > 1e-3


def test_context_order_does_not_matter_only_positions_do(oracle, context):
    """Non-causal attention over the context: permuting context rows *with* their positions is a no-op;
    permuting the rows against fixed positions is not (RoPE makes positions part of the key)."""
    _, feats = context
    block, pos = torch.tensor([5] + [1023] * 15), torch.arange(37, 53)
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(0))
    base = oracle.hidden(feats, torch.arange(37), block, pos)
    torch.testing.assert_close(oracle.hidden(feats[perm], perm, block, pos), base, rtol=1e-5, atol=1e-5)
    assert (oracle.hidden(feats[perm], torch.arange(37), block, pos) - base).abs().max() > 1e-3


def test_context_rows_must_equal_start(oracle, context):
    _, feats = context
    with pytest.raises(ValueError, match="context has 37 rows but the current token is at position 38"):
        oracle.draft_logits(feats, 5, 38)


def test_sharded_and_untied_targets(tmp_path):
    from fixtures.build.random_pair import build_random_pair

    plain_t, plain_d = build_random_pair(tmp_path / "plain", seed=3)
    sharded_t, sharded_d = build_random_pair(tmp_path / "sharded", seed=3, shards=3)
    assert (sharded_t / "model.safetensors.index.json").exists()
    feats = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    a = OracleDFlash(plain_d, plain_t).draft_logits(feats, 11, 9)
    torch.testing.assert_close(OracleDFlash(sharded_d, sharded_t).draft_logits(feats, 11, 9), a, rtol=0, atol=0)
    untied_t, untied_d = build_random_pair(tmp_path / "untied", seed=3, tied=False)
    untied = OracleDFlash(untied_d, untied_t)
    head = read_safetensors(untied_t, ["lm_head.weight"])["lm_head.weight"].float()
    torch.testing.assert_close(untied.lm_head, head, rtol=0, atol=0)
    z = untied.hidden(feats, torch.arange(9), torch.tensor([11] + [1023] * 15), torch.arange(9, 25))
    torch.testing.assert_close(untied.draft_logits(feats, 11, 9), z[1:] @ head.T, rtol=0, atol=0)


# ---------------------------------------------------------------- the speculative loop


@pytest.mark.parametrize("prompt_len,budget", [(1, 20), (5, 1), (16, 2), (17, 16), (33, 17), (100, 33)])
def test_oracle_spec_generate_is_lossless(prompt_len, budget):
    prompt = rand_ids(prompt_len, seed=prompt_len)
    run = oracle_spec_generate(TARGET, DRAFT, prompt, budget, eos_token_id=None)
    assert run.output_ids == hf_reference.greedy_ids(TARGET, prompt, budget, None)
    assert 1 + sum(run.accepted_lengths) == len(run.output_ids) == budget
    assert all(1 <= tau <= 16 for tau in run.accepted_lengths)


class ScriptedDrafter:
    """A test proposer that knows the target's greedy continuation: each draft is correct, except at
    the indices `wrong(step)` returns. Also checks the context it is handed is exactly the dense taps
    of the committed prefix (the draft-seed alignment invariant)."""

    def __init__(self, prompt: list[int], budget: int, wrong=lambda step: set()):
        self.geom = OracleDFlash(DRAFT, TARGET).geom
        self.ref = prompt + hf_reference.greedy_ids(TARGET, prompt, budget + 16, None)
        self.wrong, self.steps = wrong, 0

    def draft(self, context: torch.Tensor, current: int, start: int) -> list[int]:
        assert context.shape[0] == start and self.ref[start] == current
        dense = hf_reference.target_features(TARGET, self.ref[:start], self.geom.target_layer_ids)
        torch.testing.assert_close(context, dense, rtol=1e-5, atol=1e-5)
        drafts = self.ref[start + 1 : start + 16]
        bad = self.wrong(self.steps)
        self.steps += 1
        return [1023 if j in bad else t for j, t in enumerate(drafts)]


@pytest.mark.parametrize("budget,taus", [(40, [16, 16, 7]), (16, [15]), (17, [16]), (2, [1])])
def test_forced_acceptance_tau_equals_span(budget, taus):
    prompt = rand_ids(21, seed=4)
    run = oracle_spec_generate(TARGET, DRAFT, prompt, budget, None, drafter=ScriptedDrafter(prompt, budget))
    assert run.accepted_lengths == taus  # every draft accepted; the last span truncated to the budget
    assert run.output_ids == hf_reference.greedy_ids(TARGET, prompt, budget, None)


def test_garbage_drafts_give_tau_one():
    prompt = rand_ids(9, seed=5)
    run = oracle_spec_generate(
        TARGET, DRAFT, prompt, 12, None, drafter=ScriptedDrafter(prompt, 12, wrong=lambda s: set(range(15)))
    )
    assert run.accepted_lengths == [1] * 11
    assert run.output_ids == hf_reference.greedy_ids(TARGET, prompt, 12, None)


@pytest.mark.parametrize("seed", range(4))
def test_noisy_drafts_are_lossless(seed):
    rng = random.Random(seed)
    prompt = rand_ids(rng.randrange(1, 60), seed=seed)
    budget = rng.randrange(1, 50)
    first_wrong = [rng.randrange(0, 16) for _ in range(64)]  # the first wrong draft index of each step
    run = oracle_spec_generate(
        TARGET, DRAFT, prompt, budget, None, drafter=ScriptedDrafter(prompt, budget, wrong=lambda s: {first_wrong[s]})
    )
    assert run.output_ids == hf_reference.greedy_ids(TARGET, prompt, budget, None)
    for step, (tau, drafts) in enumerate(zip(run.accepted_lengths, run.drafts)):
        assert tau == min(first_wrong[step], len(drafts)) + 1


def test_eos_inside_a_committed_run_truncates():
    prompt = rand_ids(30, seed=6)
    plain = hf_reference.greedy_ids(TARGET, prompt, 40, None)
    j = next(i for i in range(1, 40) if plain[i] not in plain[:i])  # a token first produced at index j
    eos = plain[j]
    run = oracle_spec_generate(TARGET, DRAFT, prompt, 40, eos, drafter=ScriptedDrafter(prompt, 40))
    assert run.output_ids == plain[: j + 1] == hf_reference.greedy_ids(TARGET, prompt, 40, eos)
    assert len(run.accepted_lengths) == (1 if j <= 16 else 2)  # EOS stopped it mid-run


# ---------------------------------------------------------------- slow: against the stored goldens


@pytest.mark.slow
def test_regen_live_matches_stored_goldens():
    stored = regen.load_golden("tiny-random")
    assert stored.manifest["weights_sha256"] == pairs.weight_hashes(PAIR), "fixture changed: regenerate"
    names = [r.name for r in stored.greedy][::12]  # 4 sequences across the length range
    spec = pairs.spec_from_manifest(PAIR, stored.manifest)
    errors, stats = regen.compare(stored, regen.generate(spec, names=names, progress=False))
    assert not errors, "\n".join(errors[:20])
    assert stats["sequences"] == len(names) and stats["max_delta"] <= regen.LOGPROB_TOL


@pytest.mark.slow
def test_oracle_spec_generate_on_every_stored_prompt():
    stored = regen.load_golden("tiny-random")
    for rec in stored.greedy:
        run = oracle_spec_generate(TARGET, DRAFT, rec.prompt_ids, len(rec.output_ids), None)
        assert run.output_ids == rec.output_ids, rec.name
