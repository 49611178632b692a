"""The pytest entry point of `golden conform`, as an engine's CI would call it: `pytest -p
golden.conform.pytest_plugin --pyargs golden.conformance --conform-url ... --junitxml X` in a subprocess from
a scratch directory, against `refengine serve` (the trained tiny pair on CPU, in this process) and against
a proxy that flips one generated token. JUnit XML: one testcase per check; the real server passes topk,
greedy, concurrency and acceptance and skips baseline with its reason, and sampling, left out by
--conform-checks (about 50 s on the CPU; tests/golden/test_conform_sampling.py runs it), saying so; the
flipping proxy fails exactly the greedy testcase, whose message carries the first divergence and its regret.
Without --conform-url the session fails naming the option.

Run: PYTHONPATH=. python -m pytest tests/golden/test_conform_pytest.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import FIXTURES
from golden.conform.parse import TokenMap
from tests.adapter import cpu_engine
from tests.conform.faulty import FaultyProxy, FlipOneToken

ROOT = Path(__file__).resolve().parents[2]
PAIR = FIXTURES / "tiny-trained"
GOLDEN = ROOT / "golden" / "data" / "tiny-trained"


@pytest.fixture(scope="module")
def spec_server():
    from refengine.server.serve import BackgroundServer

    srv = BackgroundServer(cpu_engine(PAIR / "target", PAIR / "draft"), model_name="tiny-trained")
    yield srv
    srv.stop()


def run_pytest(tmp_path: Path, *options: str) -> tuple[int, str, dict[str, tuple[str, str]]]:
    """(exit code, output, testcase name -> (outcome, message)) of the conformance session."""
    xml = tmp_path / "conform.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "golden.conform.pytest_plugin", "--pyargs", "golden.conformance"]
    cmd += ["-p", "no:cacheprovider", "-q", f"--junitxml={xml}", *options]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    cases: dict[str, tuple[str, str]] = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            kids = list(case)
            outcome = kids[0].tag if kids and kids[0].tag in ("failure", "error", "skipped") else "passed"
            cases[case.get("name", "")] = (outcome, (kids[0].get("message") or "") if kids else "")
    return proc.returncode, out, cases


def options(url: str) -> list[str]:
    return [
        "--conform-url",
        url,
        "--conform-model",
        "tiny-trained",
        "--conform-pair",
        str(GOLDEN),
        "--conform-tol",
        "fp32",
        "--conform-prompts",
        "3",
        "--conform-checks",
        "topk,greedy,concurrency,baseline,acceptance",
    ]


def test_junit_xml_against_the_real_server(spec_server, tmp_path):
    code, out, cases = run_pytest(tmp_path, *options(f"http://{spec_server.host}:{spec_server.port}"))
    assert code == 0, out
    outcomes = {name.removeprefix("test_conform[").rstrip("]"): o for name, (o, _) in cases.items()}
    assert outcomes == {
        "topk": "passed",
        "greedy": "passed",
        "concurrency": "passed",
        "acceptance": "passed",
        "baseline": "skipped",
        "sampling": "skipped",
    }, out
    assert "no --baseline-url" in cases["test_conform[baseline]"][1], out
    assert "not in --conform-checks" in cases["test_conform[sampling]"][1], out


def test_junit_xml_fails_exactly_the_check_a_flipped_token_breaks(spec_server, tmp_path):
    tmap = TokenMap.from_tokenizer(PAIR / "target" / "tokenizer.json")
    word = next(s for s, ids in tmap.by_string.items() if len(ids) == 1 and len(s) > 3 and s.isalpha())
    proxy = FaultyProxy((spec_server.host, spec_server.port), FlipOneToken(nth=2, replacement=word))
    try:
        code, out, cases = run_pytest(tmp_path, *options(proxy.url))
    finally:
        proxy.stop()
    assert code == 1, out
    failed = sorted(name for name, (o, _) in cases.items() if o == "failure")
    assert failed == ["test_conform[greedy]"], out
    assert "first divergence 2" in out and "regret" in out, out


def test_missing_url_fails_naming_the_option(tmp_path):
    code, out, cases = run_pytest(tmp_path, "--conform-model", "m", "--conform-pair", str(GOLDEN))
    assert code == 1 and "--conform-url" in out, out
