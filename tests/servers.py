"""The trained tiny pair served in-process on a free loopback port (refengine.server.serve.BackgroundServer, a
uvicorn.Server in a background thread): `spec_server` runs target + DFlash drafter, `plain_server` the target
alone, each torn down at the end of the session. Registered for every test by the root conftest
(`pytest_plugins`): the server tests and the golden conformance tests share them. The server's imports load
only when a test asks for one."""

from __future__ import annotations

import pytest

from conftest import FIXTURES
from tests.adapter import cpu_engine

PAIR = FIXTURES / "tiny-trained"


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
