"""`python -m golden conform`'s usage errors: each exits 2 with its message and a JSON line last, before any
check runs: a missing required flag, an unknown --checks name, a --pair that is neither a golden set nor a
checkpoint, a server that does not answer, a bad --url, a non-positive --tau-tol, a sampling temperature of 0
or max_tokens of 0. No server or model is started.

Run: PYTHONPATH=. python -m pytest tests/golden/test_conform_cli.py -q -p no:cacheprovider
"""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import pytest

from golden.cli import main

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "data" / "tiny-trained"
BASE = ["--url", "http://127.0.0.1:1", "--model", "m", "--pair", str(GOLDEN)]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "m", "--pair", str(GOLDEN)], "--url"),
        (["--url", "http://127.0.0.1:1", "--model", "m", "--pair", str(GOLDEN), "--checks", "topk,nope"], "nope"),
        (["--url", "http://127.0.0.1:1", "--model", "m", "--pair", "/nonexistent"], "neither a stored golden set"),
        (["--url", "ftp://x", "--model", "m", "--pair", str(GOLDEN)], "http(s)://host"),
        (["--url", "http://127.0.0.1:1", "--model", "m", "--pair", str(GOLDEN), "--tau-tol", "0"], "--tau-tol"),
        ([*BASE, "--sampling-temperature", "0"], "temperature must be > 0"),
        ([*BASE, "--sampling-max-tokens", "0"], "--sampling-max-tokens"),
    ],
)
def test_usage_errors_exit_2_with_a_json_line(args, message):
    out = io.StringIO()
    code = main(["conform", *args], out)
    last = json.loads(out.getvalue().strip().splitlines()[-1])
    assert code == 2 and last["result"] == "error" and message in last["message"], out.getvalue()


def test_a_server_that_does_not_answer_exits_2():
    out = io.StringIO()
    url = f"http://127.0.0.1:{closed_port()}"
    code = main(["conform", "--url", url, "--model", "m", "--pair", str(GOLDEN)], out)
    last = json.loads(out.getvalue().strip().splitlines()[-1])
    assert code == 2 and "/metrics" in last["message"] and "ConnectionRefusedError" in last["message"], out.getvalue()
