"""Faulty servers for the conformance tests: a threaded HTTP proxy in front of a real `refengine serve`,
with one fault each, to prove every `golden conform` check fails on its own fault.

- FlipOneToken: the n-th generation answer (not an echo) has one generated token replaced by another.
- StaleLogprobs: an echo (scoring) answer is cached by the prompt's first 4 ids and its length, and a later
  prompt matching both gets the cached answer (a prefix cache that ignores the rest of the prompt).
- ConcurrentDiffers: a generation that arrives while another is in flight gets its text changed from the
  middle on (solo answers are right).
- HalfAcceptance: /metrics reports half the committed tokens of the accepted-length histogram.
- ColderSampling: a sampled request (temperature > 0) is forwarded with its temperature times `factor`
  (greedy ones pass unchanged): the answers carry real token ids, sampled from too sharp a distribution.
- UnknownNoEcho: not a fault but a lesser server: /metrics is empty (its kind is unknown), an echo answer
  has no logprobs and no answer has vLLM's token_ids, so conform must skip what it cannot check and say why.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Fault:
    """No fault: requests and answers pass through unchanged."""

    def request(self, body: dict) -> dict:
        return body

    def completion(self, body: dict, answer: dict, inflight: int) -> dict:
        return answer

    def metrics(self, text: str) -> str:
        return text


class FlipOneToken(Fault):
    def __init__(self, nth: int, replacement: str) -> None:
        self.nth, self.replacement, self.seen, self.flipped = nth, replacement, 0, 0
        self.lock = threading.Lock()

    def completion(self, body: dict, answer: dict, inflight: int) -> dict:
        if body.get("echo") or body.get("max_tokens", 16) < 4:
            return answer
        with self.lock:
            self.seen += 1
            if self.seen != self.nth:
                return answer
            self.flipped += 1
        choice = answer["choices"][0]
        lp = choice.get("logprobs")
        if lp:  # token strings and their offsets are known: replace token 2 and its text
            j, offs, old = 2, lp["text_offset"], lp["tokens"][2]
            lp["tokens"][j] = self.replacement
            end = offs[j + 1] if j + 1 < len(offs) else offs[j] + len(old)
            choice["text"] = choice["text"][: offs[j]] + self.replacement + choice["text"][end:]
        else:
            choice["text"] = choice["text"][:3] + self.replacement + choice["text"][3:]
        return answer


class StaleLogprobs(Fault):
    def __init__(self) -> None:
        self.cache: dict[tuple, dict] = {}
        self.hits = 0

    def completion(self, body: dict, answer: dict, inflight: int) -> dict:
        prompt = body.get("prompt")
        if not body.get("echo") or not isinstance(prompt, list) or len(prompt) < 4:
            return answer
        key = (tuple(prompt[:4]), len(prompt))
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        self.cache[key] = answer
        return answer


class ConcurrentDiffers(Fault):
    def __init__(self, junk: str) -> None:
        self.junk, self.changed = junk, 0

    def completion(self, body: dict, answer: dict, inflight: int) -> dict:
        if body.get("echo") or inflight < 2:
            return answer
        self.changed += 1
        choice = answer["choices"][0]
        choice["text"] = choice["text"][: len(choice["text"]) // 2] + self.junk
        return answer


class HalfAcceptance(Fault):
    SUM = re.compile(r"^(refengine_spec_accepted_length_sum\{[^}]*\}) (\S+)$", re.M)

    def metrics(self, text: str) -> str:
        return self.SUM.sub(lambda m: f"{m.group(1)} {float(m.group(2)) / 2}", text)


class ColderSampling(Fault):
    def __init__(self, factor: float) -> None:
        self.factor, self.changed = factor, 0
        self.lock = threading.Lock()

    def request(self, body: dict) -> dict:
        if body.get("temperature", 0) > 0:
            with self.lock:
                self.changed += 1
            body = {**body, "temperature": body["temperature"] * self.factor}
        return body


class UnknownNoEcho(Fault):
    def completion(self, body: dict, answer: dict, inflight: int) -> dict:
        for choice in answer["choices"]:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            if body.get("echo"):
                choice["logprobs"] = None
        return answer

    def metrics(self, text: str) -> str:
        return ""


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # the listen backlog (5 by default): the sampling check connects 16 at once


class FaultyProxy:
    """A ThreadingHTTPServer on a free loopback port forwarding to upstream (host, port) with `fault`."""

    def __init__(self, upstream: tuple[str, int], fault: Fault) -> None:
        self.fault = fault
        self.inflight = 0
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _forward(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
                with lock:
                    proxy.inflight += 1
                    inflight = proxy.inflight
                try:
                    conn = http.client.HTTPConnection(*upstream, timeout=300)
                    sent = raw
                    if raw and self.path.endswith("/completions"):
                        sent = json.dumps(proxy.fault.request(json.loads(raw))).encode()
                    conn.request(method, self.path, sent, {"Content-Type": "application/json"})
                    r = conn.getresponse()
                    status, data = r.status, r.read()
                    conn.close()
                    if status == 200 and self.path.endswith("/completions") and raw:
                        answer = proxy.fault.completion(json.loads(raw), json.loads(data), inflight)
                        data = json.dumps(answer).encode()
                    elif status == 200 and self.path == "/metrics":
                        data = proxy.fault.metrics(data.decode()).encode()
                finally:
                    with lock:
                        proxy.inflight -= 1
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
