"""vLLM's endpoints and sampling extensions (issue 51, item 10): /tokenize (a prompt, or chat messages through
the chat template), /detokenize and /version; `ignore_eos` (generation runs past EOS to max_tokens),
`min_tokens` (EOS, stop tokens and stop strings do not count before it; the EOS logit is not masked, so an
EOS inside the first min_tokens tokens is kept as a textless token) and `stop_token_ids` (the first such token
ends the answer, counted but adding no text, as EOS does). Outputs are checked against Engine.generate.
CPU, fp32, the trained tiny pair served in-process.

Run: python -m pytest -q tests/serve/test_extensions.py
"""

from __future__ import annotations

import json

import refengine
from refengine import SamplingParams
from tests.serve.conftest import call

PROMPT = [1, 2, 3]  # the trained tiny target ends it with EOS after 26 tokens


def reference_ids(reference, max_tokens, ignore_eos):
    (req,) = reference.generate([PROMPT], SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
    return req.output_ids, req.finish_reason.value


def test_tokenize_detokenize_version(spec_server, detok):
    status, out, _ = call(spec_server, "POST", "/tokenize", {"prompt": "def f(x):"})
    assert status == 200 and out["tokens"] == detok.encode("def f(x):") and out["count"] == len(out["tokens"]), out
    assert out["max_model_len"] == spec_server.loop.engine.max_context
    msgs = [{"role": "user", "content": "hi"}]
    status, out, _ = call(spec_server, "POST", "/tokenize", {"messages": msgs})
    assert status == 200 and detok.decode(out["tokens"]).endswith("assistant\n"), out
    status, back, _ = call(spec_server, "POST", "/detokenize", {"tokens": detok.encode("def f(x):")})
    assert status == 200 and back == {"prompt": "def f(x):"}, back
    status, bad, _ = call(spec_server, "POST", "/detokenize", {"tokens": [10**9]})
    assert status == 400 and bad["error"]["param"] == "tokens", bad
    status, out, _ = call(spec_server, "GET", "/version")
    assert status == 200 and out == {"version": refengine.__version__}


def test_ignore_eos(spec_server, reference, detok):
    eos_run, why = reference_ids(reference, 60, False)
    assert why == "eos" and len(eos_run) < 40, (why, len(eos_run))
    status, out, _ = call(spec_server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 40})
    assert out["usage"]["completion_tokens"] == len(eos_run) and out["choices"][0]["finish_reason"] == "stop"
    status, out, _ = call(
        spec_server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}
    )
    want, _ = reference_ids(reference, 40, True)
    assert status == 200 and out["usage"]["completion_tokens"] == 40, out
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["text"] == detok.decode(want)


def test_min_tokens(spec_server, reference, detok):
    long_run, _ = reference_ids(reference, 60, True)
    eos = spec_server.loop.engine.scheduler.eos_ids
    first_eos = next(i for i, t in enumerate(long_run) if t in eos)
    m = first_eos + 3
    body = {"prompt": PROMPT, "max_tokens": 60, "min_tokens": m, "logprobs": 1}
    status, out, _ = call(spec_server, "POST", "/v1/completions", body)
    assert status == 200, out
    n = out["usage"]["completion_tokens"]
    later = [i for i, t in enumerate(long_run) if t in eos and i >= m]
    assert n == (later[0] + 1 if later else 60), (n, m, long_run)
    assert out["choices"][0]["text"] == detok.decode(long_run[:n])
    assert len(out["choices"][0]["logprobs"]["tokens"]) == n


def test_stop_token_ids(spec_server, reference, detok):
    run, _ = reference_ids(reference, 20, True)
    k = 5
    stop_id = run[k]
    first = run.index(stop_id)
    body = {"prompt": PROMPT, "max_tokens": 20, "stop_token_ids": [stop_id], "ignore_eos": True}
    for stream in (False, True):
        if stream:
            status, raw, _ = call(spec_server, "POST", "/v1/completions", {**body, "stream": True})
            events = [json.loads(x[6:]) for x in raw.split("\n") if x.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        else:
            status, out, _ = call(spec_server, "POST", "/v1/completions", body)
            text, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
            assert out["usage"]["completion_tokens"] == first + 1, (out, first)
        assert status == 200 and finish == "stop"
        assert text == detok.decode(run[:first]), (text, detok.decode(run[: first + 1]))
