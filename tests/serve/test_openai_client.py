"""The OpenAI-compatible server, driven by the real `openai` client (and raw HTTP where the client hides it).

Checks: completions, chat (the tokenizer's chat template), streaming and logprobs equal Engine.generate /
Engine.score on the same prompts (greedy); the fields the OpenAI client and lm-eval send by default (seed,
user, n=1, top_p=1, zero penalties, empty logit_bias, stream_options) are accepted; many concurrent clients
with mixed budgets each get their bs=1 output; a client that disconnects mid-stream frees its KV blocks at
once; bad requests (an out-of-range temperature among them) get 400 with an OpenAI error body (an internal
failure 500) and the server keeps serving; /v1/models, /health and /metrics. CPU, fp32, the trained tiny pair
served in-process on 127.0.0.1. Sampling (temperature > 0, seed, n) is tests/serve/test_sampling.py.

Run: python -m pytest -q tests/serve/test_openai_client.py
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from refengine import SamplingParams
from refengine.server.loadtest import DEFAULT_PROMPTS as PROMPTS
from tests.serve.conftest import require, wait_idle

TIMEOUT = 60.0
DEFAULTS = dict(seed=1234, user="test", n=1, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias={})


def client(srv):
    return require("openai").OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def generate_text(reference, detok, ids, max_tokens):
    (req,) = reference.generate([ids], SamplingParams(max_tokens=max_tokens))
    return detok.decode(req.output_ids), req


def post(srv, path, body):
    req = urllib.request.Request(srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completions_equal_generate(spec_server, reference, detok):
    c = client(spec_server)
    for i, p in enumerate(PROMPTS[:4]):
        kw = {} if i % 2 else {"temperature": 0}  # temperature omitted or 0 are both greedy
        out = c.completions.create(model="tiny-trained", prompt=p, max_tokens=24, **kw, **DEFAULTS)
        want, req = generate_text(reference, detok, detok.encode(p), 24)
        assert out.choices[0].text == want, p
        assert out.choices[0].finish_reason == ("length" if req.finish_reason.value == "length" else "stop")
        assert out.usage.completion_tokens == len(req.output_ids)
    # token-id prompts and a batch of prompts in one request
    ids = [detok.encode(p) for p in PROMPTS[:3]]
    out = c.completions.create(model="tiny-trained", prompt=ids, max_tokens=12, temperature=0.0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    for ch, pid in zip(out.choices, ids):
        assert ch.text == generate_text(reference, detok, pid, 12)[0]


def test_chat_uses_template(spec_server, reference, detok):
    from conftest import FIXTURES
    from refengine.server.serve import chat_template_of

    assert "<|im_start|>" in chat_template_of(FIXTURES / "tiny-trained" / "target")
    c = client(spec_server)
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    out = c.chat.completions.create(model="tiny-trained", messages=msgs, max_tokens=20, **DEFAULTS)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + "<|im_start|>assistant\n"
    want, _ = generate_text(reference, detok, detok.encode(rendered), 20)
    assert out.choices[0].message.content == want
    assert out.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="tiny-trained", messages=msgs, max_tokens=20, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want


def test_streaming_equals_generate(spec_server, reference, detok):
    c = client(spec_server)
    for p in PROMPTS[:3]:
        stream = c.completions.create(
            model="tiny-trained",
            prompt=p,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
            **DEFAULTS,
        )
        chunks = list(stream)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        want, req = generate_text(reference, detok, detok.encode(p), 32)
        assert text == want
        assert chunks[-1].usage.completion_tokens == len(req.output_ids)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("length", "stop")


def test_stop_strings(spec_server, reference, detok):
    c = client(spec_server)
    p = PROMPTS[0]
    want, _ = generate_text(reference, detok, detok.encode(p), 40)
    assert "\n" in want
    out = c.completions.create(model="tiny-trained", prompt=p, max_tokens=40, stop=["\n"])
    assert out.choices[0].text == want[: want.index("\n")] and out.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="tiny-trained", prompt=p, max_tokens=40, stop="\n", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want[: want.index("\n")]
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(spec_server)  # the stop string aborted the engine request: its KV is freed


def test_logprobs(spec_server, reference, detok):
    c = client(spec_server)
    p = PROMPTS[2]
    ids = detok.encode(p)
    out = c.completions.create(model="tiny-trained", prompt=p, max_tokens=8, logprobs=3)
    lp = out.choices[0].logprobs
    (req,) = reference.generate([ids], SamplingParams(max_tokens=8, logprobs=3))
    assert out.choices[0].text == detok.decode(req.output_ids)
    assert len(lp.token_logprobs) == len(req.output_ids) == len(lp.top_logprobs)
    for got, tops, (tid, (top_ids, top_lp)) in zip(lp.token_logprobs, lp.top_logprobs, zip(req.output_ids, req.topk)):
        assert got == pytest.approx(top_lp[0], abs=1e-5) and tid == top_ids[0]
        assert len(tops) == 3 and max(tops.values()) == pytest.approx(top_lp[0], abs=1e-5)
    chunks = list(c.completions.create(model="tiny-trained", prompt=p, max_tokens=8, logprobs=3, stream=True))
    streamed = [
        x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx([top_lp[0] for _, top_lp in req.topk], abs=1e-5)
    msgs = [{"role": "user", "content": p}]
    chat = c.chat.completions.create(model="tiny-trained", messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    # echo + logprobs: the prompt tokens' logprobs (what lm-eval's loglikelihood reads) match Engine.score
    out = c.completions.create(model="tiny-trained", prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(p)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    (scored,) = reference.score([(ids[:1], ids[1:])], k=64)
    for j in range(1, len(ids)):
        top_ids, top_lp = scored.topk[j - 1]
        if ids[j] in top_ids:
            assert lp.token_logprobs[j] == pytest.approx(top_lp[top_ids.index(ids[j])], abs=1e-4)
        assert max(lp.top_logprobs[j].values()) == pytest.approx(top_lp[0], abs=1e-4)
    # max_tokens=0 with echo scores the prompt only
    status, body = post(spec_server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 200 and body["choices"][0]["text"] == p
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)


def test_concurrent_clients_get_bs1_outputs(spec_server, reference, detok):
    n = 12
    jobs = [(PROMPTS[i % len(PROMPTS)], 4 + 5 * i) for i in range(n)]  # mixed budgets 4..59
    want = [generate_text(reference, detok, detok.encode(p), m)[0] for p, m in jobs]
    got: list = [None] * n
    c = client(spec_server)

    def run(i):
        p, m = jobs[i]
        if i % 3 == 0:
            got[i] = "".join(
                ch.choices[0].text
                for ch in c.completions.create(model="tiny-trained", prompt=p, max_tokens=m, stream=True, **DEFAULTS)
            )
        else:
            got[i] = c.completions.create(model="tiny-trained", prompt=p, max_tokens=m, **DEFAULTS).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert got == want
    wait_idle(spec_server)


def test_disconnect_mid_stream_frees_kv(spec_server):
    wait_idle(spec_server)
    aborted_before = spec_server.loop.snapshot["finished"].get("aborted", 0)
    conn = http.client.HTTPConnection(spec_server.host, spec_server.port, timeout=TIMEOUT)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "def main():", "max_tokens": 3000, "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    line = resp.readline()
    while not line.startswith(b"data: "):
        line = resp.readline()
    deadline = time.monotonic() + 10
    while spec_server.loop.snapshot["kv_blocks_used"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the snapshot is published just after the chunk
    assert spec_server.loop.snapshot["kv_blocks_used"] > 0
    resp.close()
    conn.close()  # the client goes away mid-stream
    s = wait_idle(spec_server, timeout=15.0)
    assert s["finished"].get("aborted", 0) == aborted_before + 1
    with urllib.request.urlopen(spec_server.url + "/metrics", timeout=TIMEOUT) as r:
        text = r.read().decode()
    assert 'refengine_kv_blocks_used{model="tiny-trained"} 0.0' in text


def test_disconnect_while_waiting_non_stream_frees_kv(spec_server):
    wait_idle(spec_server)
    conn = http.client.HTTPConnection(spec_server.host, spec_server.port, timeout=TIMEOUT)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "def main():", "max_tokens": 3000}),
        {"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 10
    while spec_server.loop.snapshot["kv_blocks_used"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spec_server.loop.snapshot["kv_blocks_used"] > 0
    conn.close()  # gone before the answer: the handler notices within POLL_S and aborts
    wait_idle(spec_server, timeout=15.0)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "logprobs": 1000}, "logprobs"),
        ({"prompt": [1, 2, 999999]}, "prompt"),
        ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_requests_get_400(spec_server, body, param):
    status, out = post(spec_server, "/v1/completions", body)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param
    assert out["error"]["message"]
    status, out = post(spec_server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4})
    assert status == 200 and out["choices"][0]["text"]


def test_openai_client_sees_400_and_server_keeps_serving(spec_server):
    openai = require("openai")
    c = client(spec_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-trained", messages=[{"role": "user", "content": "x"}], temperature=3.0)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny-trained", prompt="x", stream=True, max_tokens=100000)
    assert c.completions.create(model="tiny-trained", prompt="x", max_tokens=2).choices[0].text is not None


def test_internal_failure_is_500_and_request_finished(spec_server):
    wait_idle(spec_server)
    eng = spec_server.loop.engine
    real_step = eng.step

    def failing_step():
        eng.step = real_step
        real_step()  # admit and run a step so the request holds KV, then fail
        raise RuntimeError("injected failure")

    eng.step = failing_step
    try:
        status, out = post(spec_server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 50})
    finally:
        eng.step = real_step
    assert status == 500 and "injected failure" in out["error"]["message"]
    wait_idle(spec_server)
    status, out = post(spec_server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4})
    assert status == 200


def test_models_health_metrics(spec_server):
    assert [m.id for m in client(spec_server).models.list().data] == ["tiny-trained"]
    with urllib.request.urlopen(spec_server.url + "/health", timeout=TIMEOUT) as r:
        assert r.status == 200
    with urllib.request.urlopen(spec_server.url + "/metrics", timeout=TIMEOUT) as r:
        text = r.read().decode()
    for name in (
        "requests_running",
        "requests_waiting",
        "kv_blocks_used",
        "kv_blocks_free",
        "spec_tau",
        "spec_accepted_length_bucket",
        "draft_seconds_total",
        "verify_seconds_total",
    ):
        assert f"refengine_{name}" in text, name
