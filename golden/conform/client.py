"""A minimal HTTP client for an OpenAI-compatible server (standard library only).

`Server.complete(body)` POSTs /v1/completions and returns the parsed JSON; `Server.metrics()` GETs /metrics
as text (None when the server has no /metrics). `run_concurrently` sends several bodies at once, one thread
each, all released together by a barrier so the server sees them in the same scheduling window.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from golden.errors import GoldenError


class ServerError(GoldenError):
    """The server answered with an HTTP error, or not at all, or with a body that is not JSON."""


@dataclass(frozen=True)
class Server:
    url: str  # http://host:port (no /v1)
    model: str
    timeout: float = 300.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise GoldenError(f"--url must be http(s)://host[:port], got {self.url!r}")
        if not self.model:
            raise GoldenError("--model is empty: give the model name the server serves")
        if self.timeout <= 0:
            raise GoldenError(f"timeout must be positive, got {self.timeout}")

    def _conn(self) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return cls(parts.hostname or "", parts.port, timeout=self.timeout)

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        base = urllib.parse.urlsplit(self.url).path.rstrip("/")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn = self._conn()
        try:
            conn.request(method, base + path, json.dumps(body).encode() if body is not None else None, headers)
            r = conn.getresponse()
            return r.status, r.read()
        except OSError as e:
            raise ServerError(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from e
        finally:
            conn.close()

    def complete(self, body: dict) -> dict:
        """POST /v1/completions with `model` filled in; the JSON answer, or ServerError naming the status."""
        status, raw = self._request("POST", "/v1/completions", {"model": self.model, **body})
        if status != 200:
            raise ServerError(f"POST {self.url}/v1/completions: HTTP {status}: {raw[:500].decode('utf-8', 'replace')}")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ServerError(f"POST {self.url}/v1/completions: body is not JSON: {raw[:200]!r}") from e

    def metrics(self, settle_s: float = 2.0) -> str | None:
        """GET /metrics as text once its serving metrics read the same twice 50 ms apart (a server may count a
        request a moment after its answer ends; the process_ and python_ collectors always move), at most
        `settle_s`; None when the server answers anything but 200."""
        deadline, last = time.monotonic() + settle_s, None
        while True:
            status, raw = self._request("GET", "/metrics")
            if status != 200:
                return None
            text = raw.decode("utf-8", "replace")
            serving = [x for x in text.splitlines() if not x.startswith(("process_", "python_", "# "))]
            if serving == last or time.monotonic() > deadline:
                return text
            last = serving
            time.sleep(0.05)


def run_concurrently(server: Server, bodies: Sequence[dict]) -> list[dict]:
    """Send every body at once (one thread each, released by a barrier); answers in the bodies' order."""
    results: list[dict | BaseException | None] = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def one(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = server.complete(bodies[i])
        except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(server.timeout + 30)
    out: list[dict] = []
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            raise ServerError(f"concurrent request {i}: {r}") from r
        if r is None:
            raise ServerError(f"concurrent request {i}: no answer within {server.timeout + 30} s")
        out.append(r)
    return out
