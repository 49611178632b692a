"""Corrupt checkpoint weights fail at load with a CheckpointError that names the checkpoint, the file and the
tensor: an empty / truncated / header-only model.safetensors (target and drafter), a broken shard index,
NaN or Inf weights (also Inf created by the dtype conversion), integer weights, and an untied config with no
lm_head.weight. Tied checkpoints that store an lm_head copy still load (as HF: the copy is ignored).

Run: pytest -q tests/unit/test_corrupt_checkpoint.py
"""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

from fixtures.build.random_pair import build_random_pair
from refengine.errors import CheckpointError
from refengine.models.qwen3 import Qwen3Model
from tests.adapter import cpu_engine, edit_tensors


def _cut(f, how: str) -> None:
    raw = f.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    keep = {"empty": 0, "truncated": len(raw) // 2, "header_only": 8 + header_len, "last_bytes": len(raw) - 3}[how]
    f.write_bytes(raw[:keep])


@pytest.mark.parametrize("how", ["empty", "truncated", "header_only", "last_bytes"])
@pytest.mark.parametrize("which", ["target", "draft"])
def test_unreadable_weights_file_names_checkpoint_and_file(pair_copy, which, how):
    t, d = pair_copy
    ckpt = t if which == "target" else d
    _cut(ckpt / "model.safetensors", how)
    with pytest.raises(CheckpointError) as ei:
        cpu_engine(t, d)
    msg = str(ei.value)
    assert f"checkpoint {ckpt}:" in msg and "weights file model.safetensors" in msg, msg
    assert ("is empty (0 bytes)" if how == "empty" else "is not a readable safetensors file") in msg, msg


def test_broken_shard_index_is_named(tmp_path):
    t, _ = build_random_pair(tmp_path / "p", seed=1, shards=2)
    index = t / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=re.escape(f"{index}: sharded-checkpoint index is not valid JSON")):
        cpu_engine(t)
    index.write_text(json.dumps([1, 2]))
    with pytest.raises(CheckpointError, match="must hold a JSON object.*got a JSON list"):
        cpu_engine(t)
    index.write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
    with pytest.raises(CheckpointError, match="'weight_map' must map tensor names to shard file names"):
        cpu_engine(t)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_target_weight_is_refused_with_its_name(pair_copy, bad):
    t, _ = pair_copy
    name = "model.layers.2.mlp.down_proj.weight"

    def poison(ts):
        ts[name][3, 5] = bad

    edit_tensors(t, poison)
    nan, inf = (1, 0) if bad != bad else (0, 1)
    with pytest.raises(
        CheckpointError,
        match=rf"model\.safetensors: tensor '{re.escape(name)}' holds {nan} NaN "
        rf"and {inf} Inf values of 131072; refusing",
    ):
        cpu_engine(t)


def test_non_finite_drafter_weight_is_refused_with_its_name(pair_copy):
    t, d = pair_copy
    edit_tensors(d, lambda ts: ts["fc.weight"].view(-1)[:4].fill_(float("nan")))
    with pytest.raises(CheckpointError, match=r"draft/model\.safetensors: tensor 'fc\.weight' holds 4 NaN"):
        cpu_engine(t, d)


def test_overflow_in_dtype_conversion_is_named(pair_copy):
    t, _ = pair_copy
    edit_tensors(t, lambda ts: ts["model.norm.weight"].__setitem__(0, 1e6))  # fine in bf16, Inf in fp16
    assert isinstance(Qwen3Model.load(t, dtype=torch.float32), Qwen3Model)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.norm\.weight' holds 0 NaN and 1 Inf values of 256 after "
        r"conversion from torch\.bfloat16 to torch\.float16",
    ):
        Qwen3Model.load(t, dtype=torch.float16)


def test_integer_weight_is_refused(pair_copy):
    t, _ = pair_copy
    edit_tensors(t, lambda ts: ts.__setitem__("model.norm.weight", torch.ones(256, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype torch\.int32, expected a floating"):
        cpu_engine(t)


def test_untied_config_without_lm_head_is_refused(tmp_path):
    t, _ = build_random_pair(tmp_path / "p", seed=2, tied=False)
    edit_tensors(t, lambda ts: ts.pop("lm_head.weight"))
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"checkpoint {t}: config.json has tie_word_embeddings false but no tensor 'lm_head.weight' "
            f"(expected shape [1024, 256])"
        ),
    ):
        cpu_engine(t)
    cfg = json.loads((t / "config.json").read_text())
    del cfg["tie_word_embeddings"]  # HF's Qwen3 default is untied
    (t / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings absent \(false, as HF\) but no tensor"):
        cpu_engine(t)


def test_tied_checkpoint_storing_an_lm_head_copy_still_loads_tied(pair_copy):
    t, _ = pair_copy
    edit_tensors(t, lambda ts: ts.__setitem__("lm_head.weight", ts["model.embed_tokens.weight"] * 2))
    m = Qwen3Model.load(t)
    assert m.lm_head is m.embed_tokens, "tie_word_embeddings true: HF ties and ignores the stored copy"


def test_synthetic_untied_config_draws_its_own_lm_head(tmp_path):
    t, _ = build_random_pair(tmp_path / "p", seed=2, tied=False)
    m = Qwen3Model.load(t, synthetic=True)
    assert m.lm_head is not m.embed_tokens and m.lm_head.shape == (1024, 256)
    assert not torch.equal(m.lm_head, m.embed_tokens), "an untied model's head is its own tensor, as billed"
