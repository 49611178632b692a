"""Graceful shutdown (issue 51, item 2): `refengine serve` in a subprocess, two long generations running (one
streaming, one not, ignore_eos so they cannot end early), SIGTERM: the process exits 0 within
--shutdown-timeout plus a margin, without a traceback; the requests still running at the deadline are
aborted cleanly (the non-streaming one answers 503 in the OpenAI shape, the stream ends with a 503 error
event and `data: [DONE]`), and the port is closed. CPU, fp32, the trained tiny pair without its drafter.

Run: python -m pytest -q tests/serve/test_shutdown.py
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

from conftest import ROOT
from refengine.server.serve import free_port
from tests.serve.conftest import PAIR

SHUTDOWN_S = 2.0
MARGIN_S = 8.0  # interpreter teardown on a loaded 2-core box


def wait_up(port: int, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"refengine serve did not come up on port {port} in {timeout}s")


def test_sigterm_with_running_generations_exits_0():
    port = free_port()
    cmd = [sys.executable, "-m", "refengine", "serve", "--device", "cpu", "--no-draft", "--model"]
    cmd += [str(PAIR / "target"), "--port", str(port), "--shutdown-timeout", str(SHUTDOWN_S), "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_up(port, proc)
        ends: dict[str, tuple[int, bytes]] = {}
        body = {"prompt": "def main():", "max_tokens": 4000, "ignore_eos": True}

        def client(name: str, stream: bool) -> None:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                c.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}))
                r = c.getresponse()
                ends[name] = (r.status, r.read())  # to the end of the stream / the answer
            except (OSError, http.client.HTTPException) as e:
                ends[name] = (-1, f"{type(e).__name__}: {e}".encode())

        threads = [threading.Thread(target=client, args=(n, n == "stream")) for n in ("stream", "plain")]
        for t in threads:
            t.start()
        time.sleep(1.5)  # both admitted and generating (4000 tokens take far longer)
        assert not ends, f"a generation ended before SIGTERM: {ends}"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(SHUTDOWN_S + MARGIN_S)
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
        out = proc.stdout.read() if proc.stdout else ""
        print(f"\nSIGTERM -> exit {rc} in {took:.2f}s; clients: { {k: (v[0], v[1][-120:]) for k, v in ends.items()} }")
        assert rc == 0, f"exit status {rc} after SIGTERM (want 0):\n{out[-3000:]}"
        assert set(ends) == {"stream", "plain"}, f"a client never saw its response end: {ends}"
        status, raw = ends["plain"]
        assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down", (status, raw[-500:])
        status, raw = ends["stream"]
        events = [x[6:] for x in raw.split(b"\n") if x.startswith(b"data: ")]
        assert status == 200 and events[-1] == b"[DONE]", (status, raw[-500:])
        assert json.loads(events[-2])["error"]["code"] == "shutting_down", raw[-500:]
        assert took < SHUTDOWN_S + MARGIN_S
        assert "Traceback" not in out, out[-3000:]
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/health")
            raise AssertionError("the port still accepts connections after exit")
        except OSError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
