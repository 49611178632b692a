"""Fixtures for the server tests: the trained tiny pair served in-process on a free loopback port.

`spec_server` runs target + DFlash drafter, `plain_server` the target alone; each is a uvicorn.Server in a
background thread (refengine.server.serve.BackgroundServer), torn down at the end of the session. `reference`
is a plain CPU engine for Engine.generate / Engine.score comparisons. `require(name)` imports a test-only
client (openai, lm_eval) inside the test that needs it: collection never imports them, so `pytest -m gpu` on a
machine without them collects; a selected test whose client is missing fails naming the extra to install."""

from __future__ import annotations

import importlib
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


@pytest.fixture(scope="session")
def spec_server():
    from refengine.server.serve import BackgroundServer

    srv = BackgroundServer(cpu_engine(PAIR / "target", PAIR / "draft"), model_name="tiny-trained")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def plain_server():
    from refengine.server.serve import BackgroundServer

    srv = BackgroundServer(cpu_engine(PAIR / "target"), model_name="tiny-trained")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def reference():
    return cpu_engine(PAIR / "target")


@pytest.fixture(scope="session")
def detok():
    from refengine.server.serve import detok_of

    return detok_of(PAIR / "target")
