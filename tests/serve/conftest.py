"""Fixtures for the server tests: the trained tiny pair served in-process on a free loopback port.

`spec_server` and `plain_server` come from tests/servers.py (shared with the golden conformance tests);
`guarded_server` serves the target with small limits and an API key. `reference`
is a plain CPU engine for Engine.generate / Engine.score comparisons. `require(name)` imports a test-only
client (openai, lm_eval) inside the test that needs it: collection never imports them, so `pytest -m gpu` on a
machine without them collects; a selected test whose client is missing fails naming the extra to install."""

from __future__ import annotations

import http.client
import importlib
import json
import threading
import time
from types import ModuleType

import fastapi  # noqa: F401  (.[test] installs fastapi and uvicorn: a missing one is an install error, not a skip)
import pytest
import uvicorn  # noqa: F401

from conftest import FIXTURES
from tests.adapter import cpu_engine

PAIR = FIXTURES / "tiny-trained"
if not (PAIR / "target" / "tokenizer.json").is_file():
    pytest.fail("the trained tiny pair (fixtures/tiny-trained) is missing", pytrace=False)


TEST_EXTRA = 'pip install -e ".[test]"'


def require(module: str) -> ModuleType:
    """`import module`, or fail the calling test (never skip) naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} is not importable ({e}): it is a test-only client, install it with {TEST_EXTRA}")


def wait_idle(srv, timeout=15.0):
    """Poll the loop's snapshot until no KV block is used and no stream is live; returns the snapshot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = srv.loop.snapshot
        if s["kv_blocks_used"] == 0 and s["live_streams"] == 0 and s["running"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {timeout}s: {srv.loop.snapshot}")


def call(srv, method: str, path: str, body=None, headers=None, timeout: float = 60.0):
    """One raw HTTP request: (status, parsed JSON body or the raw text, response headers). A dict body is
    sent as JSON, bytes as they are."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, data, hdrs)
        r = conn.getresponse()
        raw = r.read()
        try:
            out = json.loads(raw)
        except ValueError:
            out = raw.decode("utf-8", "replace")
        return r.status, out, dict(r.getheaders())
    finally:
        conn.close()


class HealthProbe:
    """GET /health every `every` seconds in a thread; `latencies` are the answer times (s), `failures` the
    non-200 answers or errors."""

    def __init__(self, srv, every: float = 0.02):
        self.srv, self.every = srv, every
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.srv.host, self.srv.port, timeout=30)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/health")
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    self.failures.append(f"HTTP {r.status}")
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.failures.append(f"{type(e).__name__}: {e}")
                conn.close()
                conn = http.client.HTTPConnection(self.srv.host, self.srv.port, timeout=30)
            self.latencies.append(time.perf_counter() - t0)
            time.sleep(self.every)
        conn.close()

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(35)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=float("inf"))


API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# guarded_server's limits: small, so that each is reached by a cheap request
GUARDED = dict(
    api_key=API_KEY, max_request_bytes=1 << 20, max_waiting=2, max_prompts=4, max_stop_strings=2, max_stop_chars=8
)
GUARDED_MAX_NUM_SEQS = 2


@pytest.fixture(scope="session")
def guarded_server():
    """The target alone behind an API key (AUTH), with GUARDED's small limits and a running batch of 2."""
    from refengine.server.serve import BackgroundServer

    srv = BackgroundServer(
        cpu_engine(PAIR / "target", max_num_seqs=GUARDED_MAX_NUM_SEQS), model_name="tiny-trained", **GUARDED
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def reference():
    return cpu_engine(PAIR / "target")


@pytest.fixture(scope="session")
def detok():
    from refengine.server.serve import detok_of

    return detok_of(PAIR / "target")
