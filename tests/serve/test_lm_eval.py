"""Task-level parity with lm-eval, as upstream validated DFlash: `lm_eval --model local-completions` against
the server's /v1/completions, with the drafter (speculation on) and without (off), on two small local tasks
for the trained tiny pair (tests/serve/lm_eval_tasks/: a generate_until task and a loglikelihood /
multiple-choice task, loaded with --include_path). With --log_samples, every sample's response (generated text,
and loglikelihood + is_greedy per choice) must be identical on and off, and so must the metrics. The client
sends its default per-request `seed`; the tokenizer is the local tokenizer.json (tokenizer_backend=huggingface).

Marked `lm_eval` (deselect with -m "not lm_eval"); CI runs it. lm_eval runs as a subprocess (the real CLI),
with a timeout, against servers started in-process on free loopback ports.

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

from conftest import FIXTURES

pytestmark = pytest.mark.lm_eval
pytest.importorskip("lm_eval")

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
TASK_NAMES = ("refengine_tiny_gen", "refengine_tiny_ll")
LM_EVAL_TIMEOUT_S = 240


def run_lm_eval(url: str, out: Path) -> dict[str, list[dict]]:
    """One lm_eval run against `url`; returns {task: samples sorted by doc_id}."""
    model_args = ",".join([
        "model=tiny-trained", f"base_url={url}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={FIXTURES / 'tiny-trained' / 'target'}", "max_length=2048", "num_concurrent=3",
        "max_retries=1", "timeout=60"])
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OPENAI_API_KEY="unused")
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
           "--tasks", ",".join(TASK_NAMES), "--include_path", str(TASKS), "--log_samples",
           "--output_path", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"lm_eval against {url}: {time.monotonic() - t0:.1f}s")
    samples = {}
    for task in TASK_NAMES:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    (res,) = out.rglob("results_*.json")
    samples["results"] = [json.loads(res.read_text())["results"]]
    return samples


def test_lm_eval_spec_on_equals_off(spec_server, plain_server, tmp_path):
    on = run_lm_eval(spec_server.url, tmp_path / "on")
    off = run_lm_eval(plain_server.url, tmp_path / "off")
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
        assert {k: v for k, v in r_on.items() if "stderr" not in k} == {k: v for k, v in r_off.items()
                                                                           if "stderr" not in k}
