"""`refengine serve-bench`: N concurrent streaming clients against a running server; prints requests/s and
tok/s as JSON (last line). Standard library only (http.client + threads), so it runs on a machine with no pip.
With --soak, a mixed load that checks every answer instead (refengine/server/soak.py).

Each client loops: POST /v1/completions with stream=true and a fixed max_tokens (ignore_eos is not an OpenAI
field, so the count of streamed tokens is what is measured, from the final usage chunk), until --duration
seconds have passed or --requests requests are done. Every socket has a timeout."""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from urllib.parse import urlparse

DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "# Parse the command line\n",
    "for i in range(10):",
    "def read_config(path):",
]


def one_request(host: str, port: int, prompt: str, max_tokens: int, timeout: float) -> tuple[int, float, float]:
    """One streaming completion: (completion tokens, time to first chunk, total seconds)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(obj["error"].get("message"))
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    finally:
        conn.close()
    return tokens, ttft or 0.0, time.perf_counter() - t0


def run_load(
    url: str,
    concurrency: int,
    max_tokens: int,
    duration: float,
    max_requests: int,
    timeout: float,
    prompts: list[str] | None = None,
) -> dict:
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    prompts = prompts or DEFAULT_PROMPTS
    lock = threading.Lock()
    counts = {"requests": 0, "tokens": 0, "errors": 0}
    ttfts: list[float] = []
    latencies: list[float] = []
    started = time.perf_counter()
    deadline = started + duration
    issued = [0]

    def client(cid: int) -> None:
        while time.perf_counter() < deadline:
            with lock:
                if max_requests and issued[0] >= max_requests:
                    return
                issued[0] += 1
                k = issued[0]
            try:
                n, ttft, lat = one_request(host, port, prompts[(cid + k) % len(prompts)], max_tokens, timeout)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    counts["errors"] += 1
                print(f"client {cid}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            with lock:
                counts["requests"] += 1
                counts["tokens"] += n
                ttfts.append(ttft)
                latencies.append(lat)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()) + timeout + 5)
    elapsed = time.perf_counter() - started

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 4) if xs else 0.0

    return {
        "url": url,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "seconds": round(elapsed, 3),
        "requests": counts["requests"],
        "errors": counts["errors"],
        "tokens": counts["tokens"],
        "requests_per_s": round(counts["requests"] / elapsed, 3),
        "tok_per_s": round(counts["tokens"] / elapsed, 2),
        "mean_ttft_s": mean(ttfts),
        "mean_latency_s": mean(latencies),
    }


def cmd_serve_bench(args: argparse.Namespace) -> int:
    if args.soak:
        from refengine.server.soak import parse_mix, run_soak

        u = urlparse(args.url)
        res = run_soak(
            u.hostname or "127.0.0.1",
            u.port or 80,
            args.concurrency,
            args.duration,
            args.max_tokens,
            parse_mix(args.mix),
            args.oversize_bytes,
            args.timeout,
            api_key=args.api_key,
        )
        print(json.dumps(res))
        return 0 if res["ok"] else 1
    res = run_load(args.url, args.concurrency, args.max_tokens, args.duration, args.requests, args.timeout)
    print(json.dumps(res))
    return 0 if res["errors"] == 0 and res["requests"] > 0 else 1


def add_serve_bench_parser(sub) -> None:
    s = sub.add_parser("serve-bench", help="N concurrent streaming clients against a running `refengine serve`")
    s.add_argument("--url", default="http://127.0.0.1:8000")
    s.add_argument("--concurrency", type=int, default=32)
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--duration", type=float, default=60.0, help="seconds to keep issuing requests")
    s.add_argument("--requests", type=int, default=0, help="stop after this many requests (0: no cap)")
    s.add_argument("--timeout", type=float, default=120.0, help="socket timeout per request, seconds")
    s.add_argument(
        "--soak",
        action="store_true",
        help="mixed load checking every answer (refengine/server/soak.py); the summary JSON is the last line, "
        "exit 0 when no valid request failed, every oversized one got 413 and the KV blocks drained to 0",
    )
    s.add_argument(
        "--mix",
        default="stream=30,plain=15,logprobs=15,stop=15,chat=10,disconnect=10,oversized=5",
        help="--soak: request kinds and their weights",
    )
    s.add_argument("--oversize-bytes", type=int, default=9 << 20, help="--soak: body size of an oversized request")
    s.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    s.set_defaults(func=cmd_serve_bench)
