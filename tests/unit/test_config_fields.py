"""config.json fields are type-checked: ModelConfig.from_hf / DFlashConfig.from_hf turn a JSON list, a string,
float or bool where an int belongs, a negative or zero size, a non-bool flag, a bad eos id... into a
CheckpointError naming the file, the field and the value (where they used to raise AttributeError/TypeError,
or silently accept int("16") / bool("false") / 0 -> default). The published Qwen3-4B and z-lab DFlash-b16
configs still parse, including integer rope_theta and transformers 5's rope_parameters.

Run: pytest -q tests/unit/test_config_fields.py
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from fixtures.build.random_pair import draft_config, target_config
from refengine.config import DFlashConfig, ModelConfig, read_config_json
from refengine.errors import CheckpointError, UnsupportedConfigError
from tests.adapter import cpu_engine

FIXTURE_CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


def _write(tmp_path, cfg, name="config.json"):
    f = tmp_path / name
    f.write_text(json.dumps(cfg))
    return f


def _expect(f, field, value) -> str:
    return re.escape(f"config {f}: field {field!r} is {value!r}")


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("num_hidden_layers", "4", "an integer >= 1"),
        ("num_hidden_layers", 4.0, "an integer >= 1"),
        ("hidden_size", True, "an integer >= 1"),
        ("vocab_size", -5, "an integer >= 1"),
        ("num_key_value_heads", 0, "an integer >= 1"),  # was silently replaced by num_attention_heads
        ("head_dim", 128.5, "an integer >= 1"),
        ("intermediate_size", [512], "an integer >= 1"),
        ("max_position_embeddings", "2048", "an integer >= 1"),
        ("rms_norm_eps", "1e-6", "a finite number > 0"),
        ("rms_norm_eps", 0, "a finite number > 0"),
        ("rope_theta", -1.0, "a finite number > 0"),
        ("rope_theta", float("inf"), "a finite number > 0"),
        ("tie_word_embeddings", "false", "true or false"),  # bool("false") was True
        ("attention_bias", "false", "true or false"),  # was 'attention_bias=true is not Qwen3'
        ("use_sliding_window", 0, "true or false"),
        ("eos_token_id", "2", "a token id >= 0, a list of them, or null"),
        ("eos_token_id", [2, 3.0], "a token id >= 0, a list of them, or null"),
        ("eos_token_id", -1, "a token id >= 0, a list of them, or null"),
    ],
)
def test_target_field_of_wrong_type_or_range_names_file_field_and_value(tmp_path, field, value, expected):
    f = _write(tmp_path, dict(target_config(), **{field: value}))
    with pytest.raises(
        CheckpointError, match=_expect(f, field, value) + r" \(a JSON \w+\), expected " + re.escape(expected)
    ):
        ModelConfig.from_hf(read_config_json(tmp_path))


def test_missing_required_field_names_the_file(tmp_path):
    cfg = target_config()
    del cfg["max_position_embeddings"]
    f = _write(tmp_path, cfg)
    with pytest.raises(
        CheckpointError, match=re.escape(f"target config {f}: lacks required field 'max_position_embeddings'")
    ):
        ModelConfig.from_hf(read_config_json(tmp_path))


@pytest.mark.parametrize("text,kind", [("[1, 2, 3]", "list"), ('"qwen3"', "string"), ("null", "null")])
def test_config_json_that_is_not_an_object(tmp_path, text, kind):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{tmp_path / 'config.json'}: config.json must hold a JSON object {{...}}, got a JSON {kind}"),
    ):
        read_config_json(tmp_path)
    with pytest.raises(CheckpointError, match=f"target config.json must be a JSON object, got a JSON {kind}"):
        ModelConfig.from_hf(json.loads(text))


def test_engine_load_reports_a_string_layer_count(tmp_path, random_pair):
    t = tmp_path / "target"
    shutil.copytree(random_pair.target, t)
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers="4")))
    with pytest.raises(CheckpointError, match=_expect(t / "config.json", "num_hidden_layers", "4")):
        cpu_engine(t)


@pytest.mark.parametrize(
    "edit,field,value",
    [
        (lambda c: c.__setitem__("block_size", "16"), "block_size", "16"),  # int("16") was accepted
        (lambda c: c.__setitem__("block_size", 16.0), "block_size", 16.0),
        (lambda c: c.__setitem__("block_size", -4), "block_size", -4),
        (lambda c: c["dflash_config"].__setitem__("mask_token_id", 3.5), "dflash_config.mask_token_id", 3.5),
        (lambda c: c["dflash_config"].__setitem__("mask_token_id", -1), "dflash_config.mask_token_id", -1),
        (lambda c: c["dflash_config"].__setitem__("target_layer_ids", "1,2"), "dflash_config.target_layer_ids", "1,2"),
        (
            lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1, -2]),
            "dflash_config.target_layer_ids[1]",
            -2,
        ),
        (
            lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1, True]),
            "dflash_config.target_layer_ids[1]",
            True,
        ),
        (lambda c: c.__setitem__("num_target_layers", "4"), "num_target_layers", "4"),
        (lambda c: c.__setitem__("dflash_config", [1]), "dflash_config", [1]),
    ],
    ids=lambda x: None if callable(x) else repr(x),
)
def test_drafter_field_of_wrong_type_or_range_names_file_field_and_value(tmp_path, edit, field, value):
    cfg = draft_config(target_config())
    edit(cfg)
    f = _write(tmp_path, cfg)
    with pytest.raises(CheckpointError, match="drafter " + _expect(f, field, value)):
        DFlashConfig.from_hf(read_config_json(tmp_path))


def test_block_size_nested_in_dflash_config_and_block_one_unsupported(tmp_path):
    cfg = draft_config(target_config())
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    _write(tmp_path, cfg)
    assert DFlashConfig.from_hf(read_config_json(tmp_path)).block_size == 16
    cfg["dflash_config"]["block_size"] = 1
    _write(tmp_path, cfg)
    with pytest.raises(UnsupportedConfigError, match="block_size=1 must be >= 2"):
        DFlashConfig.from_hf(read_config_json(tmp_path))


def test_non_default_rope_parameters_are_unsupported(tmp_path):
    cfg = dict(target_config(), rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    _write(tmp_path, cfg)
    with pytest.raises(UnsupportedConfigError, match=r"rope_parameters=.*yarn.*default RoPE only"):
        ModelConfig.from_hf(read_config_json(tmp_path))


def test_published_configs_still_parse(tmp_path):
    """Guards the strictness: the real Qwen3-4B / z-lab b16 configs (integer rope_theta) and transformers 5's
    rope_parameters spelling parse to the expected values."""
    target = ModelConfig.from_hf(read_config_json(FIXTURE_CONFIGS / "qwen3-4b"))
    assert (target.num_layers, target.num_kv_heads, target.rope_theta, target.eos_token_ids) == (36, 8, 1e6, (151645,))
    assert target.tie_word_embeddings is True
    drafter = DFlashConfig.from_hf(read_config_json(FIXTURE_CONFIGS / "qwen3-4b-dflash-b16"))
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))
    cfg = target_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000}
    _write(tmp_path, cfg)
    assert ModelConfig.from_hf(read_config_json(tmp_path)).rope_theta == 10000.0
    cfg["rope_parameters"]["rope_theta"] = "1e4"
    f = _write(tmp_path, cfg)
    with pytest.raises(CheckpointError, match=_expect(f, "rope_parameters.rope_theta", "1e4")):
        ModelConfig.from_hf(read_config_json(tmp_path))
