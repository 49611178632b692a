"""The HTTP guard (issue 51, item 10): `--api-key` (Bearer; /health, /metrics and /version stay open, every
other path answers 401 in the OpenAI shape without it), the Host allow-list of a loopback bind (a
DNS-rebinding guard: a foreign Host is a 403), the warning for a non-loopback bind without a key, and
ServerConfig's validation. CPU, the trained tiny pair served in-process behind a key (guarded_server).

Run: python -m pytest -q tests/serve/test_guard.py
"""

from __future__ import annotations

import pytest

from refengine.errors import UnsupportedConfigError
from refengine.server.config import OPEN_PATHS, ServerConfig, is_loopback
from tests.serve.conftest import API_KEY, AUTH, call

GOOD = {"prompt": "def f(x):", "max_tokens": 2}


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}],
    ids=["none", "wrong", "no-scheme", "basic"],
)
def test_api_key_required(guarded_server, headers):
    for method, path, body in [
        ("POST", "/v1/completions", GOOD),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("GET", "/v1/nothing", None),
    ]:
        status, out, hdrs = call(guarded_server, method, path, body, headers)
        assert status == 401, (path, status, out)
        assert out["error"]["code"] == "invalid_api_key" and out["error"]["type"] == "invalid_request_error", out
        assert hdrs.get("www-authenticate") == "Bearer", hdrs
    status, out, _ = call(guarded_server, "POST", "/v1/completions", GOOD, AUTH)
    assert status == 200, out


def test_open_paths_need_no_key(guarded_server):
    assert OPEN_PATHS == ("/health", "/metrics", "/version")
    for path in OPEN_PATHS:
        status, out, _ = call(guarded_server, "GET", path)
        assert status == 200, (path, out)


@pytest.mark.parametrize(
    "host, ok",
    [
        ("localhost:8000", True),
        ("127.0.0.1", True),
        ("[::1]:80", True),
        ("LOCALHOST", True),
        ("evil.example", False),
        ("evil.example:8000", False),
        ("127.0.0.1.evil.example", False),
        ("", False),
    ],
)
def test_host_allow_list_on_loopback(guarded_server, host, ok):
    status, out, _ = call(guarded_server, "GET", "/health", None, {"Host": host})
    if ok:
        assert status == 200, (host, out)
    else:
        assert status == 403 and out["error"]["code"] == "invalid_host", (host, status, out)


def test_bind_warning_and_host_defaults():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")
    open_bind = ServerConfig("m", host="0.0.0.0")
    assert open_bind.bind_warning and "--api-key" in open_bind.bind_warning
    assert open_bind.host_names == ()  # any Host: the server is meant to be reached by name
    assert ServerConfig("m", host="0.0.0.0", api_key="k").bind_warning is None
    assert ServerConfig("m").bind_warning is None and "localhost" in ServerConfig("m").host_names
    assert ServerConfig("m", host="0.0.0.0", allowed_hosts=("api.example",)).host_names == ("api.example",)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_request_bytes": 0},
        {"max_waiting": -1},
        {"max_prompts": True},
        {"api_key": ""},
        {"api_key": "a b"},
        {"shutdown_timeout": -1},
        {"allowed_hosts": ("",)},
    ],
)
def test_server_config_validated(kw):
    with pytest.raises(UnsupportedConfigError):
        ServerConfig("m", **kw)
