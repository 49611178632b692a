"""Request inputs are validated with typed messages (refengine.validation, SamplingParams.__post_init__):
integers may be Python ints, numpy integer scalars or 0-d torch integer tensors and come out as int; bools,
floats, strings and None are an InvalidRequestError naming the field (and index) and the value; ranges
(max_tokens >= 1, logprobs 0..MAX_LOGPROBS, temperature 0..MAX_TEMPERATURE, top_k >= 0, top_p in (0, 1],
seed 0..2**63-1) are enforced where SamplingParams is built;
"outside the vocabulary" is said only of integers out of range; undecodable prompt text (surrogate-escaped
argv bytes) is an InvalidRequestError saying which byte, where.

Run: pytest -q tests/unit/test_request_validation.py
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from refengine.errors import InvalidRequestError, RefEngineError
from refengine.request import MAX_LOGPROBS, MAX_TEMPERATURE, SamplingParams
from refengine.validation import decode_prompt_arg, validate_prompt, validate_token_ids

VOCAB = 1024
INTEGER = "expected an integer (int, numpy integer or 0-d integer tensor)"


# ---- SamplingParams ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 2.5}, f"max_tokens=2.5 (float): {INTEGER}"),  # was accepted; step() raised TypeError
        ({"max_tokens": "4"}, f"max_tokens='4' (str): {INTEGER}"),
        ({"max_tokens": None}, f"max_tokens=None (NoneType): {INTEGER}"),
        ({"max_tokens": True}, f"max_tokens=True (bool): {INTEGER}"),
        ({"max_tokens": np.float64(3.0)}, f"max_tokens=3.0 (numpy.float64): {INTEGER}"),
        (
            {"max_tokens": torch.tensor([3])},
            f"max_tokens=tensor([3]) (torch.Tensor of torch.int64, shape [1]): {INTEGER}",
        ),
        ({"max_tokens": torch.tensor(3.0)}, "(torch.Tensor of torch.float32, shape []): " + INTEGER),
        ({"max_tokens": 0}, "max_tokens=0 must be >= 1"),
        ({"max_tokens": -3}, "max_tokens=-3 must be >= 1"),
        ({"logprobs": 1.0}, f"logprobs=1.0 (float): {INTEGER}"),
        ({"logprobs": -1}, f"logprobs=-1: must be in 0..{MAX_LOGPROBS}"),
        ({"logprobs": MAX_LOGPROBS + 1}, f"logprobs={MAX_LOGPROBS + 1}: must be in 0..{MAX_LOGPROBS}"),
        ({"temperature": "0"}, "temperature='0' (str): expected a number"),
        ({"temperature": None}, "temperature=None (NoneType): expected a number"),
        ({"temperature": -0.1}, f"temperature=-0.1: must be in [0, {MAX_TEMPERATURE}]"),
        ({"temperature": float("nan")}, "temperature=nan: must be in [0,"),
        ({"temperature": float("inf")}, "temperature=inf: must be in [0,"),
        ({"top_k": -1}, "top_k=-1: must be >= 0"),
        ({"top_k": 2.0}, f"top_k=2.0 (float): {INTEGER}"),
        ({"top_p": 0.0}, "top_p=0.0: must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p=1.5: must be in (0, 1]"),
        ({"seed": -1}, "seed=-1: must be in 0..2**63 - 1"),
        ({"seed": 1.5}, f"seed=1.5 (float): {INTEGER}"),
        ({"ignore_eos": 1}, "ignore_eos=1 (int): expected True or False"),
        ({"ignore_eos": "false"}, "ignore_eos='false' (str): expected True or False"),
        ({"prompt_logprobs": None, "logprobs": 2}, "prompt_logprobs=None (NoneType): expected True or False"),
        ({"prompt_logprobs": True}, "prompt_logprobs needs logprobs > 0"),
    ],
)
def test_bad_sampling_params_name_field_and_value(kwargs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_numpy_and_torch_integers_are_normalised_to_int():
    p = SamplingParams(
        max_tokens=np.int64(5),
        logprobs=torch.tensor(3, dtype=torch.int32),
        temperature=np.float32(0.0),
        ignore_eos=np.bool_(True),
    )
    assert p == SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True)
    assert [type(v) for v in (p.max_tokens, p.logprobs, p.temperature, p.ignore_eos)] == [int, int, float, bool]
    assert SamplingParams(max_tokens=np.uint8(7), temperature=0).max_tokens == 7


# ---- token ids -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ids",
    [
        [np.int64(5), np.int32(6), torch.tensor(7)],
        np.array([5, 6, 7], dtype=np.int64),
        np.array([5, 6, 7], dtype=np.uint16),
        torch.tensor([5, 6, 7]),
        torch.tensor([5, 6, 7], dtype=torch.int32),
        (5, 6, 7),
        range(5, 8),
    ],
    ids=lambda x: type(x).__name__ + (f"[{x.dtype}]" if hasattr(x, "dtype") else ""),
)
def test_integer_ids_of_any_integer_type_are_accepted_as_python_ints(ids):
    out = validate_prompt(ids, VOCAB)
    assert out == [5, 6, 7] and all(type(t) is int for t in out)


@pytest.mark.parametrize(
    "ids,message",
    [
        ([1, 2.0], "prompt_ids[1]=2.0 (float): token ids must be integers"),
        ([1, True], "prompt_ids[1]=True (bool): token ids must be integers"),
        ([None], "prompt_ids[0]=None (NoneType): token ids must be integers"),
        ([3, "7"], "prompt_ids[1]='7' (str): token ids must be integers (tokenize text first)"),
        ([np.float32(4)], "prompt_ids[0]=4.0 (numpy.float32): token ids must be integers"),
        (torch.tensor([1.0, 2.0]), "prompt_ids[0]=tensor(1.) (torch.Tensor of torch.float32, shape []): token ids"),
        (np.array([True, False]), "prompt_ids[0]=True (numpy.bool): token ids must be integers"),
        ("1 2 3", "prompt_ids='1 2 3' (str): expected a sequence of token ids (tokenize text first)"),
        (np.array([[1, 2]]), "prompt_ids has shape [1, 2] (numpy.ndarray): expected a 1-d sequence of token ids"),
        ({1, 2}, "prompt_ids={1, 2} (set): expected a list of token ids"),
        (7, "prompt_ids=7 (int): expected a list of token ids"),
    ],
)
def test_wrong_id_types_get_a_type_message_not_outside_the_vocabulary(ids, message):
    with pytest.raises(InvalidRequestError) as ei:
        validate_prompt(ids, VOCAB)
    assert message in str(ei.value) and "vocabulary" not in str(ei.value), str(ei.value)


@pytest.mark.parametrize(
    "ids,message",
    [
        ([1, 5000], "prompt_ids: ids [5000] at positions [1] outside the vocabulary 0..1023"),
        ([-1, 3, 1024], "prompt_ids: ids [-1, 1024] at positions [0, 2] outside the vocabulary 0..1023"),
        (np.array([1, 2000], dtype=np.int64), "ids [2000] at positions [1] outside the vocabulary 0..1023"),
        ([2000] * 7, "ids [2000, 2000, 2000, 2000, 2000] at positions [0, 1, 2, 3, 4] (and 2 more) outside"),
    ],
)
def test_integers_out_of_range_are_outside_the_vocabulary(ids, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        validate_prompt(ids, VOCAB)


def test_empty_prompt_and_vocabulary_edges():
    with pytest.raises(InvalidRequestError, match="empty prompt: at least one token is needed"):
        validate_prompt([], VOCAB)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        validate_prompt(np.array([], dtype=np.int64), VOCAB)
    assert validate_prompt([0, VOCAB - 1], VOCAB) == [0, VOCAB - 1]


def test_forced_ids_are_checked_with_their_field_name():
    assert validate_token_ids(torch.tensor([3, 4]), VOCAB, "forced_output_ids") == [3, 4]
    assert validate_token_ids([], VOCAB, "forced_output_ids") == []
    with pytest.raises(
        InvalidRequestError,
        match=re.escape("forced_output_ids: ids [1024] at positions [2] outside the vocabulary 0..1023"),
    ):
        validate_token_ids([3, 4, 1024], VOCAB, "forced_output_ids")
    with pytest.raises(InvalidRequestError, match=re.escape("forced_output_ids[0]=0.5 (float)")):
        validate_token_ids([0.5], VOCAB, "forced_output_ids")


# ---- prompt text ---------------------------------------------------------------------------------------------
def test_undecodable_argv_prompt_is_a_clear_invalid_request():
    raw = os.fsdecode(b"caf\xe9 au lait")  # Latin-1 bytes in a UTF-8 argv: Python hands over a surrogate
    assert "\udce9" in raw
    with pytest.raises(
        InvalidRequestError,
        match=re.escape(
            "--prompt is not valid UTF-8: byte e9 at byte offset 3 of 12 (invalid continuation byte) after "
            "'caf'; re-encode the text as UTF-8"
        ),
    ) as ei:
        decode_prompt_arg(raw)
    assert isinstance(ei.value, RefEngineError), "the CLI prints RefEngineErrors and exits 2"
    with pytest.raises(InvalidRequestError, match=re.escape("prompts.txt is not valid UTF-8: byte ff at byte offset")):
        decode_prompt_arg(b"a\xff", source="prompts.txt")
    with pytest.raises(InvalidRequestError, match=re.escape("--prompt: character 1 is a lone surrogate U+D800")):
        decode_prompt_arg("x\ud800y")
    with pytest.raises(InvalidRequestError, match=re.escape("--prompt=5 (int): expected text")):
        decode_prompt_arg(5)


def test_valid_prompt_text_passes_unchanged():
    assert decode_prompt_arg("def fibonacci(n): # ∑ 漢字 🙂") == "def fibonacci(n): # ∑ 漢字 🙂"
    assert decode_prompt_arg("café".encode()) == "café"
    assert decode_prompt_arg(os.fsdecode("café".encode())) == "café"
