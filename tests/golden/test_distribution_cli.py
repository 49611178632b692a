"""`python -m golden check distribution` end to end, in a subprocess from a scratch directory, on JSONL.

Synthetic samples drawn exactly from a seeded Markov target (tests/golden/test_distribution_gate.py) pass
with exit 0; a sharpened engine (TV 0.05) fails with exit 1 and its KS / chi-square numbers in the JSON
line; a missing record, too few positions, a malformed file and a bad --alpha exit 2 with the error's name;
the JSON line is always last.

    PYTHONPATH=. python -m pytest tests/golden/test_distribution_cli.py -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest

from golden.distribution.records import write_distribution_jsonl
from tests.golden.test_distribution_gate import CFG, Markov, make_records, sample_plain, sharpen
from tests.golden.test_gate_cli import golden_cli


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    target = Markov(21, CFG)
    engine, golden = make_records(target, 21, lambda rng, prompt: sample_plain(target, rng, prompt))
    bad, bad_golden = make_records(target, 21, lambda rng, prompt: sample_plain(target, rng, prompt, sharpen(0.05)))
    return {
        "tmp": tmp,
        "engine": write_distribution_jsonl(tmp / "engine.jsonl", engine),
        "golden": write_distribution_jsonl(tmp / "golden.jsonl", golden),
        "bad": write_distribution_jsonl(tmp / "bad.jsonl", bad),
        "bad_golden": write_distribution_jsonl(tmp / "bad_golden.jsonl", bad_golden),
        "partial": write_distribution_jsonl(tmp / "partial.jsonl", engine[1:]),
    }


def test_pass_and_fail(files):
    tmp = files["tmp"]
    code, out, res = golden_cli(
        tmp, "check", "distribution", "--engine", str(files["engine"]), "--golden", str(files["golden"])
    )
    assert code == 0 and res["result"] == "pass", out
    assert res["positions"] >= res["min_positions"] == 5119 and res["ks_p"] >= 1e-3, res
    code, out, res = golden_cli(
        tmp, "check", "distribution", "--engine", str(files["bad"]), "--golden", str(files["bad_golden"])
    )
    assert code == 1 and res["result"] == "fail", out
    assert res["ks_p"] < 1e-3 and res["ks"] > 0.04, res


def test_bad_input_exits_2(files):
    tmp = files["tmp"]
    (tmp / "junk.jsonl").write_text("{not json\n")
    cases = [
        (["--engine", str(files["partial"]), "--golden", str(files["golden"])], "CoverageError", "missing 1"),
        (
            ["--engine", str(files["engine"]), "--golden", str(files["golden"]), "--min-positions", "99999"],
            "CoverageError",
            "fewer than the 99999",
        ),
        (["--engine", str(tmp / "junk.jsonl"), "--golden", str(files["golden"])], "RecordError", "not JSON"),
        (["--engine", str(files["engine"]), "--golden", str(files["golden"]), "--alpha", "2"], "UsageError", "alpha"),
    ]
    for args, error, message in cases:
        code, out, res = golden_cli(tmp, "check", "distribution", *args)
        assert code == 2 and res["result"] == "error", out
        assert res["error"] == error and message in res["message"], res
