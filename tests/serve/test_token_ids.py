"""vLLM's `return_token_ids` on /v1/completions and /v1/chat/completions (the trained tiny pair, target +
DFlash drafter, CPU fp32, served in-process).

Checks: a seeded sampled completion with return_token_ids carries `token_ids` equal to Engine.generate's
output ids for the same SamplingParams (and its text is their decoding) and `prompt_token_ids` equal to
the prompt's; without the field neither key appears; streamed, `prompt_token_ids` comes with a choice's
first chunk only and the chunks' `token_ids` concatenate to the non-streamed ids (completions and chat,
n = 2 interleaved); n = 2 choices carry the ids of seeds seed and seed + 1; chat carries
`prompt_token_ids` beside the choices (vLLM's shape) and each choice's `token_ids`; a request with
return_token_ids and no logprobs still drafts (the engine's verify steps grow by at least its tokens'
worth); a non-bool value is a 400 naming the field.

Run: python -m pytest -q tests/serve/test_token_ids.py
"""

from __future__ import annotations

import json

import pytest

from refengine import SamplingParams
from tests.adapter import cpu_engine
from tests.serve.conftest import PAIR, call

PROMPT = "def fibonacci(n):"
MSGS = [{"role": "user", "content": "Sort a list."}]
BODY = {"model": "tiny-trained", "max_tokens": 12, "temperature": 0.8, "seed": 5, "return_token_ids": True}


@pytest.fixture(scope="module")
def spec_reference():
    return cpu_engine(PAIR / "target", PAIR / "draft")


def engine_ids(engine, prompt: list[int], seed: int) -> list[int]:
    (req,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.8, seed=seed))
    return req.output_ids


def sse(srv, path: str, body: dict) -> list[dict]:
    status, raw, _ = call(srv, "POST", path, {**body, "stream": True})
    assert status == 200, raw
    events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", raw
    return [json.loads(e) for e in events[:-1]]


def test_completion_ids_equal_generate_and_the_prompt(spec_server, spec_reference, detok):
    status, out, _ = call(spec_server, "POST", "/v1/completions", {**BODY, "prompt": PROMPT})
    assert status == 200, out
    (c,) = out["choices"]
    prompt = detok.encode(PROMPT)
    assert c["prompt_token_ids"] == prompt, c
    assert c["token_ids"] == engine_ids(spec_reference, prompt, 5), c
    assert detok.decode(c["token_ids"]) == c["text"] and len(c["token_ids"]) == out["usage"]["completion_tokens"]
    body = {**BODY, "prompt": PROMPT, "return_token_ids": False}
    status, plain, _ = call(spec_server, "POST", "/v1/completions", body)
    assert status == 200 and "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["text"] == c["text"], plain


def test_n_choices_carry_their_seeds_ids(spec_server, spec_reference, detok):
    status, out, _ = call(spec_server, "POST", "/v1/completions", {**BODY, "prompt": PROMPT, "n": 2})
    assert status == 200, out
    prompt = detok.encode(PROMPT)
    got = {c["index"]: c["token_ids"] for c in out["choices"]}
    assert got == {j: engine_ids(spec_reference, prompt, 5 + j) for j in range(2)}, got
    assert all(c["prompt_token_ids"] == prompt for c in out["choices"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_ids_equal_non_streamed(spec_server, path):
    body = {**BODY, "n": 2, **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MSGS})}
    status, whole, _ = call(spec_server, "POST", path, body)
    assert status == 200, whole
    chunks = sse(spec_server, path, body)
    ids: dict[int, list[int]] = {0: [], 1: []}
    prompt_seen: dict[int, int] = {0: 0, 1: 0}
    for ch in chunks:
        if not ch["choices"]:
            continue  # a usage chunk
        (c,) = ch["choices"]
        ids[c["index"]] += c["token_ids"]
        where = c if path == "/v1/completions" else ch  # chat: beside the choices, as vLLM's
        if "prompt_token_ids" in where:
            assert ids[c["index"]] == c["token_ids"], "prompt_token_ids after a choice's first chunk"
            prompt_seen[c["index"]] += 1
    assert prompt_seen == {0: 1, 1: 1}, chunks
    want = {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert ids == want, (ids, want)


def test_chat_shape(spec_server, detok):
    status, out, _ = call(spec_server, "POST", "/v1/chat/completions", {**BODY, "messages": MSGS})
    assert status == 200, out
    status, tok, _ = call(spec_server, "POST", "/tokenize", {"messages": MSGS})
    assert out["prompt_token_ids"] == tok["tokens"], out
    (c,) = out["choices"]
    assert "prompt_token_ids" not in c and detok.decode(c["token_ids"]) == c["message"]["content"], c


def test_return_token_ids_request_still_drafts(spec_server):
    before = spec_server.loop.snapshot["verify_steps"]
    body = {**BODY, "prompt": PROMPT, "max_tokens": 32, "seed": 11}
    status, out, _ = call(spec_server, "POST", "/v1/completions", body)
    assert status == 200, out
    n = len(out["choices"][0]["token_ids"])
    after = spec_server.loop.snapshot["verify_steps"]
    assert n > 1 and after - before >= 1, (before, after, n)
    # a logprobs request decodes plainly: its tokens add no verify step
    status, out, _ = call(spec_server, "POST", "/v1/completions", {**body, "logprobs": 1})
    assert status == 200 and spec_server.loop.snapshot["verify_steps"] == after, out


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_non_bool_is_a_400(spec_server, value):
    status, out, _ = call(spec_server, "POST", "/v1/completions", {**BODY, "prompt": PROMPT, "return_token_ids": value})
    if value is None:  # null is the default (off)
        assert status == 200 and "token_ids" not in out["choices"][0], out
        return
    assert status == 400 and out["error"]["param"] == "return_token_ids", out
