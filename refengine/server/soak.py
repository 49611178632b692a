"""`refengine serve-bench --soak`: a mixed load that checks every answer, for long runs against a server.

Each of N clients draws request kinds from a weighted mix (MIX; `--mix kind=weight,...`): streaming and
non-streaming completions, streaming logprobs (the streamed logprob count must equal the usage's
completion_tokens), stop strings, streaming chat, client disconnects (the stream is dropped after its first
chunk) and oversized bodies (`--oversize-bytes`, which must be refused with 413). A valid request fails when
it does not get a 200 with a well-formed answer (a 429 is counted apart as `busy`). Before, after a warm-up
and at the end it reads /metrics: the server's RSS (process_resident_memory_bytes) and, once the load stops
and the server drains, the KV blocks in use (must be 0). Standard library only."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from typing import Any

MIX = {"stream": 30, "plain": 15, "logprobs": 15, "stop": 15, "chat": 10, "disconnect": 10, "oversized": 5}
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):", "# 😀 emoji\n"]
STOPS = ["\n", "):", "return"]


def parse_mix(text: str) -> dict[str, int]:
    mix = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k.strip() not in MIX or not v.strip().isdigit():
            raise ValueError(f"--mix {text!r}: use kind=weight with kinds {sorted(MIX)}")
        mix[k.strip()] = int(v)
    if not any(mix.values()):
        raise ValueError(f"--mix {text!r}: every weight is 0")
    return mix


def metrics(host: str, port: int, headers: dict[str, str]) -> dict[str, float]:
    """The unlabelled-or-first sample of each metric family on /metrics."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers=headers)
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[-1]
            out.setdefault(name, float(value))
    return out


def body_of(kind: str, rng: random.Random, max_tokens: int, oversize: int) -> dict[str, Any] | bytes:
    prompt = rng.choice(PROMPTS)
    if kind == "oversized":
        return json.dumps({"prompt": "x" * oversize, "max_tokens": 1}).encode()
    if kind == "chat":
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    b: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": kind != "plain"}
    if b["stream"]:
        b["stream_options"] = {"include_usage": True}
    if kind == "logprobs":
        b["logprobs"] = 2
    if kind == "stop":
        b["stop"] = rng.sample(STOPS, 2)
    return b


def one(host: str, port: int, kind: str, body: dict | bytes, headers: dict, timeout: float) -> tuple[str, int]:
    """Send one request of the mix; (outcome, completion tokens) with outcome "ok", "busy", "rejected" (413
    for oversized), "disconnected", or an error description."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    try:
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json", **headers})
        except (BrokenPipeError, ConnectionResetError):
            pass  # an oversized body answered before it was all sent
        resp = conn.getresponse()
        if kind == "oversized":
            resp.read()
            return ("rejected", 0) if resp.status == 413 else (f"oversized got HTTP {resp.status}", 0)
        if resp.status == 429:
            resp.read()
            return "busy", 0
        if resp.status != 200:
            return f"{kind}: HTTP {resp.status} {resp.read()[:200]!r}", 0
        if kind == "plain":
            out = json.loads(resp.read())
            return "ok", out["usage"]["completion_tokens"]
        events, n_lp, usage = 0, 0, None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line[6:] == b"[DONE]":
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                return f"{kind}: error event {ev['error'].get('message')}", 0
            events += 1
            if kind == "disconnect":
                return "disconnected", 0  # the connection closes below, mid-stream
            usage = ev.get("usage") or usage
            for ch in ev.get("choices", []):
                n_lp += len((ch.get("logprobs") or {}).get("tokens", []))
        else:
            return f"{kind}: stream ended without [DONE]", 0
        n = usage["completion_tokens"] if usage else 0
        if kind != "chat" and usage is None:
            return f"{kind}: no usage chunk", 0
        if kind == "logprobs" and n_lp != n:
            return f"logprobs: {n_lp} streamed logprob tokens != {n} completion tokens", 0
        return "ok", n
    except Exception as e:  # noqa: BLE001 - reported
        return f"{kind}: {type(e).__name__}: {e}", 0
    finally:
        conn.close()


def run_soak(
    host: str,
    port: int,
    concurrency: int,
    duration: float,
    max_tokens: int,
    mix: dict[str, int],
    oversize: int,
    timeout: float,
    api_key: str | None = None,
    warmup: float | None = None,
    drain_s: float = 60.0,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    kinds, weights = zip(*[(k, w) for k, w in mix.items() if w])
    before = metrics(host, port, headers)
    warmup = min(10.0, duration / 4) if warmup is None else warmup
    lock = threading.Lock()
    sent: Counter[str] = Counter()
    outcome: Counter[str] = Counter()
    errors: list[str] = []
    tokens = [0]
    t0 = time.perf_counter()
    deadline = t0 + duration

    def client(cid: int) -> None:
        rng = random.Random(cid)
        while time.perf_counter() < deadline:
            kind = rng.choices(kinds, weights)[0]
            res, n = one(host, port, kind, body_of(kind, rng, max_tokens, oversize), headers, timeout)
            with lock:
                sent[kind] += 1
                tokens[0] += n
                if res in ("ok", "busy", "rejected", "disconnected"):
                    outcome[res] += 1
                else:
                    outcome["error"] += 1
                    errors.append(res)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    warm = metrics(host, port, headers)
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()) + timeout + 5)
    elapsed = time.perf_counter() - t0
    after = metrics(host, port, headers)
    drained_by = time.perf_counter() + drain_s
    while after.get("refengine_kv_blocks_used", 0) or after.get("refengine_requests_outstanding", 0):
        if time.perf_counter() > drained_by:
            break
        time.sleep(0.25)
        after = metrics(host, port, headers)
    rss = "process_resident_memory_bytes"
    res = {
        "mode": "soak",
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "max_tokens": max_tokens,
        "sent": dict(sent),
        "valid_ok": outcome["ok"],
        "valid_errors": outcome["error"],
        "error_samples": errors[:5],
        "busy_429": outcome["busy"],
        "disconnects": outcome["disconnected"],
        "oversized_sent": sent["oversized"],
        "oversized_rejected": outcome["rejected"],
        "tokens": tokens[0],
        "tok_per_s": round(tokens[0] / elapsed, 2),
        "kv_blocks_used_after": after.get("refengine_kv_blocks_used"),
        "requests_outstanding_after": after.get("refengine_requests_outstanding"),
        "rss_before_bytes": before.get(rss),
        "rss_after_warmup_bytes": warm.get(rss),
        "rss_after_bytes": after.get(rss),
    }
    if rss in after and rss in warm:
        res["rss_growth_after_warmup_bytes"] = after[rss] - warm[rss]
    res["ok"] = (
        outcome["error"] == 0
        and outcome["ok"] > 0
        and outcome["rejected"] == sent["oversized"]
        and after.get("refengine_kv_blocks_used") == 0
    )
    return res
