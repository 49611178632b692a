"""Bounded inputs, and no event-loop stall while they are checked (issue 51, items 1 and 7).

Item 1: a 50 MB prompt is a 413 (body limit, --max-request-bytes; default 8 MiB) whether it declares its
Content-Length or streams chunked, and so is a 10 MB junk field; a prompt under the body limit but longer
than the context allows is a 400 decided from its length (no tokenization); one that must be tokenized is
tokenized off the event loop. Throughout, /health is polled and must answer within HEALTH_S (the worst
latency is printed). Item 7: a full waiting queue is a 429 with Retry-After (and counted in /metrics), and
prompts per request, stop strings per request and stop-string length are bounded (400 naming the field).
CPU, fp32, the trained tiny pair served in-process.

Run: python -m pytest -q -s tests/serve/test_limits.py   (-s shows the /health latencies)
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tests.serve.conftest import AUTH, GUARDED, GUARDED_MAX_NUM_SEQS, HealthProbe, call, wait_idle

HEALTH_S = 0.1
MB = 1 << 20


def post_large(srv, size: int, chunked: bool) -> tuple[int, dict | str, float]:
    """POST /v1/completions with a `size`-byte JSON body (one long prompt), declared or chunked; the server may
    answer and close before the body is sent. (status, body, seconds to the answer)."""
    head = b'{"max_tokens": 4, "prompt": "'
    tail = b'"}'
    fill = size - len(head) - len(tail)
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    t0 = time.perf_counter()
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding" if chunked else "Content-Length", "chunked" if chunked else str(size))
    conn.endheaders()
    piece = b"def f(x): return x  " * (MB // 20)
    try:
        parts = [head] + [piece[: min(len(piece), fill - i)] for i in range(0, fill, len(piece))] + [tail]
        for p in parts:
            conn.send(b"%x\r\n%s\r\n" % (len(p), p) if chunked else p)
        if chunked:
            conn.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # answered before the whole body was sent
    try:
        r = conn.getresponse()
        status, raw = r.status, r.read()
    finally:
        conn.close()
    try:
        return status, json.loads(raw), time.perf_counter() - t0
    except ValueError:
        return status, raw.decode("utf-8", "replace"), time.perf_counter() - t0


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_50mb_prompt_is_413_and_health_answers(spec_server, chunked):
    with HealthProbe(spec_server) as probe:
        time.sleep(0.05)
        status, body, took = post_large(spec_server, 50 * MB, chunked)
        time.sleep(0.05)
    print(
        f"\n50 MB prompt ({'chunked' if chunked else 'Content-Length'}): HTTP {status} after {took:.3f}s; "
        f"/health worst {probe.worst * 1e3:.1f} ms over {len(probe.latencies)} probes"
    )
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large", body
    assert not probe.failures, probe.failures
    assert probe.worst < HEALTH_S, f"/health took {probe.worst * 1e3:.1f} ms while a 50 MB prompt was refused"


def test_junk_field_over_body_limit_is_413(spec_server):
    status, body, _ = call(spec_server, "POST", "/v1/completions", {"prompt": "x", "junk": "j" * (10 * MB)})
    assert status == 413 and body["error"]["type"] == "invalid_request_error", (status, body)


def test_long_prompt_rejected_off_the_event_loop(spec_server):
    """Under the body limit: 6 MB of text is over the context from its length alone; 300k characters
    (inside the length bound) are tokenized in a worker thread. Both 400 `prompt`; /health keeps answering."""
    cases = [("x" * (6 * MB), "length bound"), ("def f(x): return x + 1\n" * 13_000, "tokenized")]
    for text, what in cases:
        with HealthProbe(spec_server) as probe:
            time.sleep(0.05)
            t0 = time.perf_counter()
            status, body, _ = call(spec_server, "POST", "/v1/completions", {"prompt": text, "max_tokens": 4})
            took = time.perf_counter() - t0
            time.sleep(0.05)
        print(f"\n{len(text)} chars ({what}): HTTP {status} in {took:.3f}s, /health worst {probe.worst * 1e3:.1f} ms")
        assert status == 400 and body["error"]["param"] == "prompt", body
        assert body["error"]["code"] == "context_length_exceeded", body
        assert probe.worst < HEALTH_S, f"/health took {probe.worst * 1e3:.1f} ms during a {what} prompt"


def test_full_waiting_queue_is_429(guarded_server):
    wait_idle(guarded_server)
    cap = GUARDED_MAX_NUM_SEQS + GUARDED["max_waiting"]
    n = cap + 3
    results: list = [None] * n
    body = {"prompt": "def main():", "max_tokens": 4000, "ignore_eos": True}

    def run(i):
        try:
            results[i] = call(guarded_server, "POST", "/v1/completions", body, AUTH, timeout=4)
        except TimeoutError:
            results[i] = "timeout"  # admitted and generating: the closed connection aborts it

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    busy = [r for r in results if r != "timeout"]
    assert len(busy) == n - cap, f"{len(busy)} answered of {n} (expected {n - cap} 429s): {results}"
    for status, err, headers in busy:
        assert status == 429 and err["error"]["type"] == "rate_limit_error", err
        assert headers.get("retry-after") == "1", headers
    wait_idle(guarded_server)
    status, text, _ = call(guarded_server, "GET", "/metrics")
    line = next(x for x in text.splitlines() if x.startswith("refengine_requests_rejected_busy_total"))
    assert float(line.split()[-1]) >= n - cap, line


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": ["a"] * (GUARDED["max_prompts"] + 1)}, "prompt"),
        ({"prompt": [[1, 2]] * 1000}, "prompt"),
        ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
        ({"prompt": "x", "stop": "s" * (GUARDED["max_stop_chars"] + 1)}, "stop"),
        ({"prompt": "x", "stop": ["s" * 10_000]}, "stop"),
        ({"prompt": "x", "stop_token_ids": list(range(20))}, "stop_token_ids"),
    ],
    ids=["prompts", "1000-prompts", "stop-count", "stop-length", "stop-10k", "stop-token-ids"],
)
def test_request_limits(guarded_server, body, param):
    wait_idle(guarded_server)  # (an earlier test's aborted generations must not count against the queue's cap)
    status, out, _ = call(guarded_server, "POST", "/v1/completions", body, AUTH)
    assert status == 400 and out["error"]["param"] == param, out
    ok = {"prompt": ["a"] * GUARDED["max_prompts"], "max_tokens": 2, "stop": ["a", "b"]}
    status, out, _ = call(guarded_server, "POST", "/v1/completions", ok, AUTH)
    assert status == 200 and len(out["choices"]) == GUARDED["max_prompts"], out
