"""The gate CLI end to end, as another engine's CI would call it: `python -m golden check ...` in a
subprocess, from a scratch directory, on JSONL files. Records written by HF transformers itself
(golden.hf_reference: teacher-forced top-k of every golden sequence, greedy runs) and by golden's oracle
loop (acceptance) pass with exit 0; a perturbed copy fails with exit 1 at the right record and position;
every coverage error (no records, partial, a name twice, an unknown name, other input ids, k < 8) and
every bad input exits 2 with its message; the JSON line is always last. And golden imports without
refengine (refengine made unimportable in a subprocess), the gates and the CLI without torch.

Run: pytest tests/golden/test_gate_cli.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from golden import hf_reference
from golden.oracle_dflash import oracle_spec_generate
from golden.pairs import pair_spec
from golden.records import GreedyRecord, write_jsonl
from golden.regen import load_golden

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "golden" / "data"


def golden_cli(tmp_path: Path, *args: str) -> tuple[int, str, dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "golden", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr[-2000:]}"
    return proc.returncode, proc.stdout, json.loads(lines[-1])


@pytest.fixture(scope="module")
def random_golden():
    return load_golden("tiny-random")


@pytest.fixture(scope="module")
def hf_topk(random_golden):
    """HF's own teacher-forced top-8 at every position of every tiny-random golden sequence."""
    target = pair_spec("tiny-random").target_dir
    return hf_reference.teacher_forced_topk(target, {r.name: r.token_ids for r in random_golden.topk}, k=8)


def test_topk_hf_records_pass_and_a_perturbed_copy_fails(tmp_path, random_golden, hf_topk):
    write_jsonl(tmp_path / "hf.jsonl", hf_topk)
    rc, out, res = golden_cli(
        tmp_path, "check", "topk", "--engine", "hf.jsonl", "--golden", str(DATA / "tiny-random"), "--fp32"
    )
    assert rc == 0 and res["result"] == "pass" and res["tol"] == "fp32", out
    assert res["records"] == 48 and res["positions"] == random_golden.manifest["positions"] and res["max"] < 1e-4
    assert "hf_gate PASS" in out
    # the engine's argmax at one position becomes a token HF ranks far lower: that position, and only it, fails
    rec_i = 20
    rec = hf_topk[rec_i]
    pos = next(p for p, lps in enumerate(rec.topk_logprobs) if lps[0] - lps[5] > 1.0)
    ids = [list(r) for r in rec.topk_ids]
    ids[pos][0], ids[pos][5] = ids[pos][5], ids[pos][0]
    write_jsonl(
        tmp_path / "bad.jsonl", hf_topk[:rec_i] + [dataclasses.replace(rec, topk_ids=ids)] + hf_topk[rec_i + 1 :]
    )
    rc, out, res = golden_cli(tmp_path, "check", "topk", "--engine", "bad.jsonl", "--golden", str(DATA / "tiny-random"))
    assert rc == 1 and res["result"] == "fail" and res["tol"] == "bf16", out
    assert res["violations"] == 1 and res["first_violations"][0]["name"] == rec.name
    assert res["first_violations"][0]["position"] == pos and res["first_violations"][0]["regret"] > 1.0
    assert f"{rec.name} pos {pos}: pick {ids[pos][0]}" in out


def test_greedy_hf_records_pass_and_a_perturbed_copy_fails(tmp_path, random_golden):
    target = pair_spec("tiny-random").target_dir
    subset = random_golden.greedy[::6]  # 8 prompts over the length range: an explicit subset via --names
    names = ",".join(r.name for r in subset)
    hf = hf_reference.greedy(target, {r.name: r.prompt_ids for r in subset}, 24, None)
    write_jsonl(tmp_path / "g.jsonl", hf)
    rc, out, res = golden_cli(
        tmp_path, "check", "greedy", "--engine", "g.jsonl", "--golden", str(DATA / "tiny-random"), "--names", names
    )
    assert rc == 0 and res["identical"] == res["records"] == 8, out
    assert "8 of 48 golden records (explicit subset)" in out
    bad = list(hf)
    out_ids = list(bad[3].output_ids)
    out_ids[5] = (out_ids[5] + 1) % 1000
    bad[3] = GreedyRecord(bad[3].name, bad[3].prompt_ids, out_ids)
    write_jsonl(tmp_path / "bad.jsonl", bad)
    rc, out, res = golden_cli(
        tmp_path,
        "check",
        "greedy",
        "--engine",
        "bad.jsonl",
        "--golden",
        str(DATA / "tiny-random" / "greedy.jsonl"),
        "--names",
        names,
    )
    assert rc == 1 and res["mismatches"] == 1, out
    m = res["first_mismatches"][0]
    assert m["name"] == bad[3].name and m["position"] == 5
    assert m["got"][m["position"] - m["context_start"]] == out_ids[5]
    assert f"{bad[3].name}: first divergence at generated position 5" in out


def test_acceptance_oracle_records_pass_and_a_perturbed_copy_fails(tmp_path):
    spec = pair_spec("tiny-trained")
    golden = {r.name: r for r in load_golden("tiny-trained").acceptance}
    names = ["code-sort", "prose-river"]
    recs = []
    for n in names:
        run = oracle_spec_generate(spec.target_dir, spec.draft_dir, golden[n].prompt_ids, 24, spec.eos_token_id)
        recs.append(
            dataclasses.replace(
                golden[n], output_ids=run.output_ids, accepted_lengths=run.committed_lengths, draft_margins=[]
            )
        )
    write_jsonl(tmp_path / "a.jsonl", recs)
    args = ["--golden", str(DATA / "tiny-trained"), "--names", ",".join(names)]
    rc, out, res = golden_cli(tmp_path, "check", "acceptance", "--engine", "a.jsonl", *args)
    assert rc == 0 and res["identical"] == 2 and res["steps_equal"] == res["golden_steps"], out
    steps = list(recs[0].accepted_lengths)
    i = next(j for j, c in enumerate(steps[:-1]) if c > 1)  # move one token from step i to step i+1
    steps[i], steps[i + 1] = steps[i] - 1, steps[i + 1] + 1
    write_jsonl(tmp_path / "bad.jsonl", [dataclasses.replace(recs[0], accepted_lengths=steps), recs[1]])
    rc, out, res = golden_cli(tmp_path, "check", "acceptance", "--engine", "bad.jsonl", *args)
    assert rc == 1 and res["failures"] == 1, out
    assert f"code-sort step {i}: committed {steps[i]}, golden {steps[i] + 1}" in res["first_failures"][0]


def _greedy_golden(names=("a", "b", "c")):
    return [GreedyRecord(n, [1, 2, 3], [4, 5]) for n in names]


@pytest.mark.parametrize(
    "case,engine,message",
    [
        ("empty", [], "no engine records: nothing was gated against the 3 greedy golden records"),
        (
            "partial",
            _greedy_golden("a"),
            "partial coverage: engine wrote 1 of the 3 greedy golden records; missing 2: 'b', 'c'",
        ),
        ("duplicate", _greedy_golden("aabc"), "engine records hold these names more than once: 'a'"),
        ("unknown", _greedy_golden("abcz"), "engine records with no greedy golden record: 'z'"),
        (
            "other ids",
            _greedy_golden("ab") + [GreedyRecord("c", [1, 9, 3], [4, 5])],
            "c: engine and greedy golden records hold different prompt_ids (first difference at 1",
        ),
    ],
)
def test_coverage_errors_exit_2(tmp_path, case, engine, message):
    write_jsonl(tmp_path / "golden.jsonl", _greedy_golden())
    write_jsonl(tmp_path / "e.jsonl", engine)
    rc, out, res = golden_cli(tmp_path, "check", "greedy", "--engine", "e.jsonl", "--golden", "golden.jsonl")
    assert rc == 2 and res["result"] == "error" and res["error"] == "CoverageError", out
    assert message in res["message"] and message in out.splitlines()[0]


def test_narrow_topk_exits_2(tmp_path, random_golden):
    narrow = [
        dataclasses.replace(
            r, topk_ids=[row[:5] for row in r.topk_ids], topk_logprobs=[row[:5] for row in r.topk_logprobs]
        )
        for r in random_golden.topk
    ]
    write_jsonl(tmp_path / "e.jsonl", narrow)
    rc, out, res = golden_cli(tmp_path, "check", "topk", "--engine", "e.jsonl", "--golden", str(DATA / "tiny-random"))
    assert rc == 2 and "need k >= 8 top tokens per row for the head deltas; 48 have fewer" in res["message"], out


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["check", "greedy", "--engine", "missing.jsonl", "--golden", str(DATA / "tiny-random")],
            "no such record file",
        ),
        (
            ["check", "acceptance", "--engine", "x.jsonl", "--golden", str(DATA / "tiny-random")],
            "no golden acceptance records at",
        ),
        (["check", "greedy", "--engine", "x.jsonl"], "the following arguments are required: --golden"),
        (["check", "topk", "--engine", "x.jsonl", "--golden", ".", "--tol", "fp8"], "invalid choice: 'fp8'"),
        (
            ["check", "greedy", "--engine", "notjson.jsonl", "--golden", str(DATA / "tiny-random")],
            "notjson.jsonl:1: not JSON",
        ),
    ],
)
def test_bad_input_exits_2(tmp_path, args, message):
    (tmp_path / "x.jsonl").write_text("")
    (tmp_path / "notjson.jsonl").write_text("{nope\n")
    rc, out, res = golden_cli(tmp_path, *args)
    assert rc == 2 and res["result"] == "error" and message in res["message"], out


def test_golden_imports_without_refengine(tmp_path):
    code = (
        "import sys; sys.modules['refengine'] = None\n"
        "import golden.cli, golden.acceptance, golden.greedy_gate, golden.features, golden.regen, "
        "golden.oracle_dflash\n"
        "assert not [m for m in sys.modules if m.startswith('refengine') and sys.modules[m] is not None]\n"
        "print('ok')"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    # the gates and the CLI need neither torch nor transformers: a CI box with plain Python can run them
    no_torch = (
        "import sys; sys.modules['torch'] = sys.modules['transformers'] = None\n"
        "import golden.cli, golden.acceptance, golden.greedy_gate, golden.gates, golden.coverage\nprint('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", no_torch], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    offenders = [
        p.name
        for p in (ROOT / "golden").glob("*.py")
        if any(line.lstrip().startswith(("import refengine", "from refengine")) for line in p.read_text().splitlines())
    ]
    assert not offenders, f"golden files importing refengine: {offenders}"
