"""read_stop_ids returns the ids HF generate() stops on: generation_config.json's eos_token_id (an id or a
list; none at all when that file has none) when the file exists, else config.json's. Checked against
transformers' own resolution (the generation_config of a model loaded from a temp checkpoint dir), then by
running HF generate() and golden.hf_reference.greedy_ids on the tiny random target: both stop exactly where
read_stop_ids says. Broken generation_config.json files are a CheckpointError naming the file.

Run: pytest -q tests/unit/test_stop_ids.py
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from golden import hf_reference
from refengine.config import ModelConfig, read_config_json, read_stop_ids
from refengine.errors import CheckpointError

PROMPT = [11, 300, 9, 4]
NEW_TOKENS = 16


def _checkpoint(tmp_path, random_pair, name: str, config_eos, generation: dict | str | None):
    """The tiny random target with config.json's eos_token_id replaced and an optional generation_config.json;
    the weights are a symlink to the fixture's."""
    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((random_pair.target / "config.json").read_text())
    cfg["eos_token_id"] = config_eos
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").symlink_to(random_pair.target / "model.safetensors")
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (d / "generation_config.json").write_text(text)
    return d


def _stop_ids(d):
    return read_stop_ids(d, ModelConfig.from_hf(read_config_json(d)))


@pytest.mark.parametrize(
    "config_eos,generation",
    [
        (2, None),  # no generation_config.json: config.json's id
        ([2, 5], None),
        (None, None),
        (2, {"eos_token_id": [7, 3]}),  # real Qwen3 checkpoints: two ids here, one in config.json
        (2, {"eos_token_id": 9}),
        (2, {"eos_token_id": [4, 4]}),
        (2, {}),  # the file exists without eos: HF stops on nothing
        (2, {"eos_token_id": None, "do_sample": False}),
    ],
    ids=lambda x: json.dumps(x),
)
def test_read_stop_ids_matches_transformers_resolution(tmp_path, random_pair, config_eos, generation):
    d = _checkpoint(tmp_path, random_pair, "ckpt", config_eos, generation)
    hf = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).generation_config.eos_token_id
    hf_ids = () if hf is None else tuple(dict.fromkeys([hf] if isinstance(hf, int) else hf))
    assert _stop_ids(d) == hf_ids


def test_hf_generate_and_golden_greedy_stop_where_read_stop_ids_says(tmp_path, random_pair):
    free = hf_reference.greedy_ids(random_pair.target, PROMPT, NEW_TOKENS, None)
    first_seen = [i for i, t in enumerate(free) if t not in free[:i]]
    assert len(first_seen) >= 3, f"need a prompt whose greedy run has 3 distinct tokens: {free}"
    early, late = free[first_seen[0]], free[first_seen[-1]]
    unused = next(t for t in range(3, 1024) if t not in free)
    cases = {  # dir -> (config.json eos, generation_config.json, index of the token HF should stop after)
        "config_only": (early, None, first_seen[0]),
        "generation_wins": (early, {"eos_token_id": [unused, late]}, first_seen[-1]),
        "generation_without_eos": (early, {"do_sample": False}, NEW_TOKENS - 1),
    }
    for name, (config_eos, generation, stop_at) in cases.items():
        d = _checkpoint(tmp_path, random_pair, name, config_eos, generation)
        stop = _stop_ids(d)
        predicted = next((i for i, t in enumerate(free) if t in stop), NEW_TOKENS - 1)
        assert predicted == stop_at, (name, stop, free)
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, attn_implementation="eager")
        with torch.inference_mode():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, len(PROMPT) :].tolist() == free[: stop_at + 1], f"{name}: HF generate, stop ids {stop}"
        golden = hf_reference.greedy_ids(d, PROMPT, NEW_TOKENS, list(stop) or None)
        assert golden == free[: stop_at + 1], f"{name}: golden greedy with stop ids {stop}"


@pytest.mark.parametrize(
    "text,message",
    [
        ("{bad", "generation_config.json is not valid JSON"),  # HF silently falls back to config.json here
        ("[151645]", "generation_config.json must hold a JSON object {...}, got a JSON list"),
        ('{"eos_token_id": "2"}', "field 'eos_token_id' is '2' (a JSON string), expected a token id >= 0"),
        ('{"eos_token_id": [2, true]}', "field 'eos_token_id' is [2, True] (a JSON list), expected a token id"),
        ('{"eos_token_id": [2, 5000]}', "eos_token_id [5000] outside the vocabulary 0..1023"),
    ],
)
def test_broken_generation_config_names_the_file(tmp_path, random_pair, text, message):
    d = _checkpoint(tmp_path, random_pair, "ckpt", 2, text)
    with pytest.raises(CheckpointError, match=re.escape(str(d / "generation_config.json")) + ".*" + re.escape(message)):
        _stop_ids(d)


def test_config_eos_outside_vocabulary_is_refused(tmp_path, random_pair):
    d = _checkpoint(tmp_path, random_pair, "ckpt", [2, 1024], None)
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"config {d / 'config.json'}: eos_token_id [1024] outside the vocabulary 0..1023"),
    ):
        _stop_ids(d)
