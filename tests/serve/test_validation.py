"""Malformed and unsupported requests get a 4xx in OpenAI's error shape, never a 500 or a silent 200 (issue
51, items 4, 5, 6, 9): a lone surrogate in a prompt, message or stop string is a 400; an unknown model a 404;
fields that would change the output (response_format, tools, tool_choice, logit_bias on chat, top_logprobs
without logprobs, an unknown message role, min_p when sampling, ...) a 400 naming them; so is
a sampling field out of range (temperature outside 0..2 or NaN, top_p outside (0, 1], top_k below -1, a seed
outside 0..2**63 - 1, n outside 1..max_prompts or prompts x n above it); types are strict (`max_tokens: true`,
`stream: "yes"` are 400s); unknown routes (404), wrong methods (405) and unparsable bodies (400) use the
OpenAI shape; a prompt longer than the context names `prompt`, one that fits but not with its max_tokens
names `max_tokens`. Each rejection is followed by a good request that must succeed. CPU, fp32, the trained
tiny pair served in-process.

Run: python -m pytest -q tests/serve/test_validation.py
"""

from __future__ import annotations

import pytest

from tests.serve.conftest import call

MSG = [{"role": "user", "content": "hi"}]


def assert_openai_error(status, body, want_status, param=None):
    assert status == want_status, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
    if param is not None:
        assert err["param"] == param, err


def still_serving(srv):
    status, out, _ = call(srv, "POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 2})
    assert status == 200 and out["choices"][0]["text"] is not None, out


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', None),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"]}', None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
        ("/tokenize", b'{"prompt": "\\ud83d"}', None),
    ],
    ids=["prompt", "stop", "message", "tokenize"],
)
def test_lone_surrogate_is_400(spec_server, path, raw, param):
    status, body, _ = call(spec_server, "POST", path, raw)
    assert_openai_error(status, body, 400, param)
    assert "surrogate" in body["error"]["message"], body
    still_serving(spec_server)


def test_unknown_model_is_404(spec_server):
    for path, body in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "nope", "messages": MSG}),
    ]:
        status, out, _ = call(spec_server, "POST", path, body)
        assert_openai_error(status, out, 404, "model")
        assert out["error"]["code"] == "model_not_found", out
    status, out, _ = call(spec_server, "POST", "/v1/completions", {"model": "tiny-trained", "prompt": "x"})
    assert status == 200 and out["model"] == "tiny-trained", out


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"5": 2.0}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/v1/chat/completions", {"messages": MSG, "repetition_penalty": 1.3}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x", "temperature": "0"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": [True, False]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": "x", "temperature": 2.01}, "temperature"),
        ("/v1/chat/completions", {"messages": MSG, "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": MSG, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
        ("/v1/chat/completions", {"messages": MSG, "top_k": 1.5}, "top_k"),
        ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
        ("/v1/completions", {"prompt": "x", "temperature": 0.7, "min_p": 0.1}, "min_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 40}, "n"),
        ("/v1/chat/completions", {"messages": MSG, "n": -1}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ],
)
def test_unsupported_or_mistyped_field_is_400(spec_server, path, body, param):
    status, out, _ = call(spec_server, "POST", path, body)
    assert_openai_error(status, out, 400, param)
    still_serving(spec_server)


def test_nan_temperature_is_400(spec_server):
    status, out, _ = call(spec_server, "POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}')
    assert_openai_error(status, out, 400, "temperature")
    still_serving(spec_server)


def test_routing_and_parse_errors_use_openai_shape(spec_server):
    status, out, _ = call(spec_server, "GET", "/v1/nothing")
    assert_openai_error(status, out, 404)
    status, out, _ = call(spec_server, "GET", "/v1/completions")
    assert_openai_error(status, out, 405)
    for raw in (b"{not json", b"[1, 2]", b'"just a string"', b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b""):
        status, out, _ = call(spec_server, "POST", "/v1/completions", raw)
        assert_openai_error(status, out, 400)
        assert "Traceback" not in str(out) and "/" not in out["error"]["message"].replace("n/a", ""), out
    still_serving(spec_server)


def test_context_errors_name_the_right_param(spec_server):
    ctx = spec_server.loop.engine.max_context
    status, out, _ = call(spec_server, "POST", "/v1/completions", {"prompt": [5] * (ctx + 10), "max_tokens": 1})
    assert_openai_error(status, out, 400, "prompt")
    status, out, _ = call(spec_server, "POST", "/v1/completions", {"prompt": [5] * 10, "max_tokens": ctx})
    assert_openai_error(status, out, 400, "max_tokens")
