"""Fixtures for the server tests: the trained tiny pair served in-process on a free loopback port.

`spec_server` runs target + DFlash drafter, `plain_server` the target alone; each is a uvicorn.Server in a
background thread (refengine.server.serve.BackgroundServer), torn down at the end of the session. `reference`
is a plain CPU engine for Engine.generate / Engine.score comparisons."""

from __future__ import annotations

import fastapi  # noqa: F401  (.[test] installs fastapi and uvicorn: a missing one is an install error, not a skip)
import pytest
import uvicorn  # noqa: F401

from conftest import FIXTURES
from tests.adapter import cpu_engine

PAIR = FIXTURES / "tiny-trained"
if not (PAIR / "target" / "tokenizer.json").is_file():
    pytest.fail("the trained tiny pair (fixtures/tiny-trained) is missing", pytrace=False)


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
