"""Task-level parity with lm-eval, as upstream validated DFlash: `lm_eval --model local-completions` against
the server's /v1/completions, with the drafter (speculation on) and without (off), on two small local tasks
for the trained tiny pair (tests/serve/lm_eval_tasks/: a generate_until task and a loglikelihood /
multiple-choice task, loaded with --include_path). With --log_samples, every sample's response (generated text,
and loglikelihood + is_greedy per choice) must be identical on and off, and so must the metrics. The client
sends its default per-request `seed`; the tokenizer is the local tokenizer.json (tokenizer_backend=huggingface).

Marked `lm_eval` (deselect with -m "not lm_eval"); CI runs it. lm-eval runs in a subprocess with a timeout
(tests/serve/lm_eval_driver.py: lm-eval's Python API, which can skip indexing its built-in tasks; the CLI
equivalent is in README.md) against servers started in-process on free loopback ports.

Run: python -m pytest -q tests/serve/test_lm_eval.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serve.conftest import require

pytestmark = pytest.mark.lm_eval

DRIVER = Path(__file__).resolve().parent / "lm_eval_driver.py"
TASK_NAMES = ("refengine_tiny_gen", "refengine_tiny_ll")
LM_EVAL_TIMEOUT_S = 240


def run_lm_eval(urls: list[str], out: Path) -> dict:
    """lm-eval's local-completions against each URL (one subprocess); {"import_s", "runs": [per URL]}."""
    env = dict(
        os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OPENAI_API_KEY="unused"
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(out), *urls],
        env=env,
        capture_output=True,
        text=True,
        cwd=DRIVER.parent / "lm_eval_tasks",
        timeout=LM_EVAL_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    print(
        f"lm-eval: {time.monotonic() - t0:.1f}s with the subprocess start, per server "
        f"{[r['seconds'] for r in res['runs']]}s"
    )
    return res


def test_lm_eval_spec_on_equals_off(spec_server, plain_server, tmp_path):
    require("lm_eval")  # the driver subprocess imports it; missing fails here with the extra to install
    on, off = (
        r["samples"] | {"results": [r["results"]]}
        for r in run_lm_eval([spec_server.url, plain_server.url], tmp_path / "lm_eval.json")["runs"]
    )
    assert spec_server.loop.snapshot["verify_steps"] > 0  # the drafter really speculated
    assert plain_server.loop.snapshot["verify_steps"] == 0
    gen_on, gen_off = on["refengine_tiny_gen"], off["refengine_tiny_gen"]
    assert len(gen_on) == len(gen_off) == 8
    for a, b in zip(gen_on, gen_off):
        assert a["resps"] == b["resps"], f"doc {a['doc_id']}: spec on {a['resps']!r} != off {b['resps']!r}"
        assert a["resps"][0][0], f"doc {a['doc_id']}: empty generation"
    ll_on, ll_off = on["refengine_tiny_ll"], off["refengine_tiny_ll"]
    assert len(ll_on) == len(ll_off) == 6
    for a, b in zip(ll_on, ll_off):
        assert a["resps"] == b["resps"], f"doc {a['doc_id']}: loglikelihoods differ"
        assert a["acc"] == b["acc"]
    for task in TASK_NAMES:
        r_on, r_off = on["results"][0][task], off["results"][0][task]
        assert {k: v for k, v in r_on.items() if "stderr" not in k} == {
            k: v for k, v in r_off.items() if "stderr" not in k
        }
