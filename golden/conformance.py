"""`pytest --pyargs golden.conformance --conform-url URL --conform-model NAME --conform-pair DIR`: the
`golden conform` checks as pytest tests, one per check, for an engine's CI (JUnit XML with --junitxml).

The options come from golden/conform/pytest_plugin.py (`-p golden.conform.pytest_plugin`, or its entry point
once installed). The checks run once per pytest run (a session-scoped fixture); a failing check fails its test
with the check's report (the numbers: first divergent position, regret, deltas); a check that could not run (no
--conform-baseline-url, a server that exports no speculative counters, a server without `token_ids` for
sampling) or that --conform-checks left out is a skip carrying its reason.
"""

from __future__ import annotations

import io
import json

import pytest

from golden.conform.cli import CHECK_NAMES, EXIT_USAGE

# the same import graph as the CLI: nothing here imports refengine


@pytest.fixture(scope="session")
def conform_run(request: pytest.FixtureRequest) -> tuple[dict, str]:
    try:
        from golden.conform.pytest_plugin import conform_argv

        argv = conform_argv(request.config)
    except ValueError:  # option not registered: the plugin was not loaded
        pytest.fail("golden.conformance needs its options: run pytest with -p golden.conform.pytest_plugin")
    missing = [f"--conform-{n}" for n in ("url", "model", "pair") if f"--{n}" not in argv]
    if missing:
        pytest.fail(f"golden.conformance needs {', '.join(missing)}")
    from golden.cli import main

    out = io.StringIO()
    code = main(argv, out)
    text = out.getvalue()
    result = json.loads(text.strip().splitlines()[-1])
    if code == EXIT_USAGE:
        pytest.fail(f"golden conform could not run:\n{text}")
    return result, text


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_conform(check: str, conform_run: tuple[dict, str]) -> None:
    result, text = conform_run
    got = result["checks"].get(check)
    if got is None and check not in result["chosen"]:
        pytest.skip(f"{check}: not in --conform-checks")
    if got is None:
        pytest.fail(f"check {check} did not run:\n{text}")
    if got["status"] == "skip":
        pytest.skip(f"{check}: {got['summary']}")
    section = [line for line in text.splitlines() if line.startswith(f"[{got['status'].upper()}] {check}:")]
    block = text[text.index(section[0]) :].split("\n[", 1)[0] if section else got["summary"]
    assert got["status"] != "fail", block
