"""`pytest -m gpu` must collect on a machine without the test-only clients (openai, lm_eval): no module under
tests/serve imports them at collection time. A subprocess runs `pytest --collect-only -m gpu tests/serve`
with a meta-path blocker that makes `import openai` / `import lm_eval` raise ImportError, and must exit 0
(5, "no tests collected", also counts: no serve test is gpu-marked, the point is no collection error). And a
selected test whose client is missing fails (not skips) naming the extra to install.

Run: python -m pytest -q tests/serve/test_collection.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT
from tests.serve.conftest import TEST_EXTRA, require

BLOCKED = ("openai", "lm_eval")
BLOCKER = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ImportError(f"{{name}} blocked by tests/serve/test_collection.py")
            return None

    sys.meta_path.insert(0, Blocker())
    for m in {BLOCKED!r}:
        try:
            __import__(m)
        except ImportError:
            pass
        else:
            raise SystemExit(f"the blocker did not block {{m}}")
    import pytest
    sys.exit(pytest.main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("marker", ["gpu", "not gpu"], ids=["select-m", "select-rest"])
def test_collects_without_test_clients(marker):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER, "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker, "tests/serve"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode in (0, 5), f"collection failed (exit {proc.returncode}) with openai/lm_eval blocked:\n{out}"
    assert "error" not in proc.stdout.lower().split("\n")[-2], out
    if marker == "not gpu":
        assert "test_openai_client.py::test_logprobs" in proc.stdout, out


def test_missing_client_fails_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` now raises ImportError
    with pytest.raises(pytest.fail.Exception) as e:
        require("openai")
    assert TEST_EXTRA in str(e.value) and "openai" in str(e.value), str(e.value)
