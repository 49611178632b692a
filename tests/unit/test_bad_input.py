"""Every bad input gets a clear, typed error and loses nothing: broken checkpoints,
drafters that do not fit, unsupported configs, and requests rejected at admission (context length at the
limit and one past it, KV budget, empty / out-of-vocab prompts, max_tokens <= 0) while the engine keeps
serving everyone else.

Run: pytest tests/unit/test_bad_input.py
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fixtures.build.random_pair import build_random_pair, draft_config, write_checkpoint
from refengine import FinishReason, SamplingParams
from refengine.errors import CheckpointError, InvalidRequestError, UnsupportedConfigError
from refengine.request import RejectReason
from tests.adapter import cpu_engine, edit_tensors


def test_missing_tensor_names_file_and_tensor(pair_copy):
    t, _ = pair_copy
    edit_tensors(t, lambda ts: ts.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*missing.*\[128\]"):
        cpu_engine(t)


def test_misshaped_tensor_names_expected_and_actual(pair_copy):
    t, _ = pair_copy
    edit_tensors(t, lambda ts: ts.__setitem__("model.norm.weight", torch.ones(255, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.norm\.weight.*\[255\].*expected \[256\]"):
        cpu_engine(t)


def test_misnamed_tensor_is_reported(pair_copy):
    t, _ = pair_copy
    edit_tensors(
        t, lambda ts: ts.__setitem__("model.layers.0.mlp.gate.weight", ts.pop("model.layers.0.mlp.gate_proj.weight"))
    )
    with pytest.raises(CheckpointError, match="gate_proj"):
        cpu_engine(t)


def test_sharded_and_untied_checkpoints_load_and_agree(tmp_path):
    one, _ = build_random_pair(tmp_path / "one", seed=3, tied=False)
    two, _ = build_random_pair(tmp_path / "two", seed=3, tied=False, shards=3)
    assert (two / "model.safetensors.index.json").is_file()
    a = cpu_engine(one).generate([[1, 2, 3]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_ids
    b = cpu_engine(two).generate([[1, 2, 3]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_ids
    assert a == b


def test_drafter_geometry_mismatch_fails_at_load(pair_copy, tmp_path):
    t, _ = pair_copy
    tcfg = json.loads((t / "config.json").read_text())
    wrong = dict(tcfg, hidden_size=384, intermediate_size=512)
    d2 = write_checkpoint(tmp_path / "d2", draft_config(wrong), {})  # config check fires before tensors
    with pytest.raises(UnsupportedConfigError, match="hidden_size 384 != target 256"):
        cpu_engine(t, d2)
    d3 = tmp_path / "d3"
    shutil.copytree(pair_copy[1], d3)
    cfg = json.loads((d3 / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 7]
    (d3 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError, match=r"target_layer_ids \[7\] outside 0..3"):
        cpu_engine(t, d3)


def test_non_qwen3_target_and_unsupported_configs(pair_copy):
    t, d = pair_copy
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    with pytest.raises(UnsupportedConfigError, match="Qwen3 only"):
        cpu_engine(t, d)
    with pytest.raises(InvalidRequestError, match="temperature=-0.7: must be in"):
        SamplingParams(temperature=-0.7)


def test_bad_requests_are_rejected_and_others_still_served(random_pair):
    e = cpu_engine(random_pair.target, random_pair.draft)
    good = e.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    empty = e.add_request([], SamplingParams(max_tokens=5))
    oov = e.add_request([1, 5000], SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError, match="max_tokens=0 must be >= 1"):
        SamplingParams(max_tokens=0)  # refused where it is built (tests/unit/test_request_validation.py)
    while e.has_work():
        e.step()
    assert good.finish_reason is FinishReason.LENGTH and len(good.output_ids) == 5
    for r, why in ((empty, "empty prompt"), (oov, "outside the vocabulary 0..1023")):
        assert r.finish_reason is FinishReason.REJECTED and r.reject_reason is RejectReason.INVALID
        assert why in r.message, r.message
    e.check_integrity()


def test_context_length_admission_at_limit_and_one_past(random_pair):
    e = cpu_engine(random_pair.target, random_pair.draft)
    limit = e.max_context_tokens()
    assert limit == 2048 - 16, "DFlash on: min(target window, drafter window - block size)"
    at = e.add_request([1] * (limit - 2), SamplingParams(max_tokens=2, ignore_eos=True))
    past = e.add_request([1] * (limit - 1), SamplingParams(max_tokens=2, ignore_eos=True))
    while e.has_work():
        e.step()
    assert at.finish_reason is FinishReason.LENGTH and len(at.output_ids) == 2
    assert past.reject_reason is RejectReason.CONTEXT_LENGTH
    assert f"= {limit + 1} > max context {limit}" in past.message, past.message
    assert cpu_engine(random_pair.target).max_context_tokens() == 2048, "DFlash off: the target's window"
    e.check_integrity()


def test_kv_budget_admission_at_limit_and_one_past(random_pair):
    e = cpu_engine(random_pair.target, random_pair.draft, num_blocks=4)  # 4 blocks x 16 = 64 tokens
    at = e.add_request([1] * 60, SamplingParams(max_tokens=4, ignore_eos=True))
    past = e.add_request([1] * 61, SamplingParams(max_tokens=4, ignore_eos=True))
    queued = e.add_request([1] * 8, SamplingParams(max_tokens=8, ignore_eos=True))  # waits for `at` to finish
    while e.has_work():
        e.step()
    assert at.finish_reason is FinishReason.LENGTH
    assert past.reject_reason is RejectReason.KV_BUDGET and "needs 5 KV blocks" in past.message, past.message
    assert queued.finish_reason is FinishReason.LENGTH and len(queued.output_ids) == 8
    e.check_integrity()
    assert e.pool.allocator.num_free == 4
