"""Sampling through the OpenAI-compatible server, driven by the real `openai` client (the target + DFlash
drafter of the trained tiny pair, CPU fp32, served in-process).

Checks: a completion at temperature > 0 with a seed (and top_p, vLLM's top_k) is the text Engine.generate
gives with the same SamplingParams, and the same on a second call; seeds 7 and 8 give different texts (on
PROMPT at TEMPERATURE over TOKENS tokens they part within the first few tokens; the draws are deterministic,
so this holds on every run of a given build); temperature > 0 without a seed runs; a streamed answer at
temperature > 0 with a seed equals the non-streamed one (completions and chat); `n` choices are indexed
0..n-1 (completions: prompt i's choice j at i * n + j), choice j is the single answer with seed + j, streamed
choices (interleaved, each chunk naming its index) concatenate per index to the non-streamed ones with the
same finish reasons and usage (with a stop string too, the stopped choices' KV freed), a client leaving a
streamed n=2 mid-stream aborts both choices, and unseeded choices draw their own seeds (at least two of four
differ).
Out-of-range values are in tests/serve/test_validation.py.

Run: python -m pytest -q tests/serve/test_sampling.py
"""

from __future__ import annotations

import http.client
import json

import pytest

from refengine import SamplingParams
from tests.adapter import cpu_engine
from tests.serve.conftest import PAIR, require, wait_idle

PROMPT = "def fibonacci(n):"
TEMPERATURE = 0.8
TOKENS = 12
MSGS = [{"role": "user", "content": "Sort a list."}]
TIMEOUT = 120.0


def client(srv):
    return require("openai").OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def complete(c, **kw) -> str:
    kw = {"model": "tiny-trained", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": TEMPERATURE, **kw}
    return c.completions.create(**kw).choices[0].text


def chat(c, **kw) -> str:
    kw = {"model": "tiny-trained", "messages": MSGS, "max_tokens": TOKENS, "temperature": TEMPERATURE, **kw}
    return c.chat.completions.create(**kw).choices[0].message.content


@pytest.fixture(scope="module")
def spec_reference():
    """A second target + drafter engine, as the server's: same seed, same tokens (alone or in a batch)."""
    return cpu_engine(PAIR / "target", PAIR / "draft")


def test_seeded_completion_repeats_and_equals_generate(spec_server, spec_reference, detok):
    c = client(spec_server)
    kw = dict(seed=7, top_p=0.9, extra_body={"top_k": 20})
    first, again = complete(c, **kw), complete(c, **kw)
    assert first == again, f"seed 7 gave two texts: {first!r} vs {again!r}"
    params = SamplingParams(max_tokens=TOKENS, temperature=TEMPERATURE, top_p=0.9, top_k=20, seed=7)
    (req,) = spec_reference.generate([detok.encode(PROMPT)], params)
    want = detok.decode(req.output_ids)
    assert first == want, f"server {first!r} != Engine.generate {want!r} (same SamplingParams)"
    other = complete(c, seed=8, top_p=0.9, extra_body={"top_k": 20})
    assert other != first, f"seeds 7 and 8 gave the same text {first!r}"
    greedy = complete(c, temperature=0)
    assert first != greedy, f"the seeded sample equals the greedy text {greedy!r}: temperature not applied?"


def test_unseeded_sampling_runs(spec_server):
    out = client(spec_server).completions.create(
        model="tiny-trained", prompt=PROMPT, max_tokens=TOKENS, temperature=1.0
    )
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("length", "stop"), out


def test_seeded_stream_equals_non_stream(spec_server):
    c = client(spec_server)
    want = complete(c, seed=11)
    kw = dict(model="tiny-trained", max_tokens=TOKENS, temperature=TEMPERATURE, seed=11, stream=True)
    chunks = list(c.completions.create(prompt=PROMPT, **kw))
    got = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert got == want, f"streamed {got!r} != non-streamed {want!r}"
    want = chat(c, seed=11)
    chunks = list(c.chat.completions.create(messages=MSGS, **kw))
    got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert got == want, f"streamed chat {got!r} != non-streamed {want!r}"


def test_n_choices_are_seed_plus_j(spec_server):
    c = client(spec_server)
    kw = dict(model="tiny-trained", max_tokens=TOKENS, temperature=TEMPERATURE)
    out = c.completions.create(prompt=PROMPT, seed=7, n=3, **kw)
    assert [ch.index for ch in out.choices] == [0, 1, 2], out.choices
    singles = [c.completions.create(prompt=PROMPT, seed=7 + j, **kw) for j in range(3)]
    got, want = [ch.text for ch in out.choices], [s.choices[0].text for s in singles]
    assert got == want, f"n=3 choices {got} != single answers with seeds 7, 8, 9 {want}"
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles), out.usage
    # two prompts x n=2: prompt i's choice j at index i * 2 + j
    two = c.completions.create(prompt=[PROMPT, MSGS[0]["content"]], seed=7, n=2, **kw)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3], two.choices
    assert [ch.text for ch in two.choices[:2]] == want[:2], (two.choices, want)
    second = [c.completions.create(prompt=MSGS[0]["content"], seed=7 + j, **kw).choices[0].text for j in range(2)]
    assert [ch.text for ch in two.choices[2:]] == second, (two.choices, second)
    # chat: choice j is the single chat answer with seed 7 + j
    res = c.chat.completions.create(messages=MSGS, seed=7, n=2, **kw)
    assert [ch.index for ch in res.choices] == [0, 1], res.choices
    got = [ch.message.content for ch in res.choices]
    assert got == [chat(c, seed=7), chat(c, seed=8)], got


def test_streamed_n_choices_equal_non_streamed(spec_server):
    c = client(spec_server)
    kw = dict(model="tiny-trained", max_tokens=TOKENS, temperature=TEMPERATURE, seed=7, n=3)
    want = c.completions.create(prompt=PROMPT, **kw)
    chunks = list(c.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw))
    got, finish = ["", "", ""], [None, None, None]
    for ch in chunks:
        for x in ch.choices:
            got[x.index] += x.text
            finish[x.index] = x.finish_reason or finish[x.index]
    assert got == [x.text for x in want.choices], f"streamed n=3 {got} != non-streamed {want.choices}"
    assert finish == [x.finish_reason for x in want.choices], finish
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens, (chunks[-1].usage, want.usage)
    res = c.chat.completions.create(messages=MSGS, **kw)
    chunks = list(c.chat.completions.create(messages=MSGS, stream=True, **kw))
    got, roles = ["", "", ""], [0, 0, 0]
    for ch in chunks:
        for x in ch.choices:
            got[x.index] += x.delta.content or ""
            roles[x.index] += x.delta.role == "assistant"
    assert got == [x.message.content for x in res.choices], f"streamed chat n=3 {got} != {res.choices}"
    assert roles == [1, 1, 1], f"each choice's first delta carries the role once: {roles}"


def test_streamed_n_with_stop_and_disconnect_free_every_choice(spec_server):
    c = client(spec_server)
    kw = dict(model="tiny-trained", max_tokens=24, temperature=TEMPERATURE, seed=7, n=3, stop=["\n"])
    out = c.completions.create(prompt=PROMPT, **kw)
    want, finish = [x.text for x in out.choices], [x.finish_reason for x in out.choices]
    assert "stop" in finish, f"no choice reached the stop string, so it is not exercised: {finish} {want}"
    got = ["", "", ""]
    for ch in c.completions.create(prompt=PROMPT, stream=True, **kw):
        for x in ch.choices:
            got[x.index] += x.text
    assert got == want, f"streamed n=3 with a stop string {got} != non-streamed {want}"
    wait_idle(spec_server)  # the choices that hit the stop string were aborted: their KV is freed
    aborted = spec_server.loop.snapshot["finished"].get("aborted", 0)
    body = {"prompt": "def main():", "max_tokens": 3000, "temperature": 1.0, "n": 2, "stream": True}
    conn = http.client.HTTPConnection(spec_server.host, spec_server.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    while not resp.readline().startswith(b"data: "):
        pass
    resp.close()
    conn.close()  # the client goes away mid-stream
    s = wait_idle(spec_server, timeout=15.0)
    assert s["finished"].get("aborted", 0) == aborted + 2, f"both choices should be aborted: {s['finished']}"


def test_unseeded_choices_draw_their_own_seeds(spec_server):
    out = client(spec_server).completions.create(
        model="tiny-trained", prompt=PROMPT, max_tokens=TOKENS, temperature=1.0, n=4
    )
    texts = [ch.text for ch in out.choices]
    assert len(set(texts)) >= 2, f"four unseeded choices at temperature 1 are one text: {texts}"
