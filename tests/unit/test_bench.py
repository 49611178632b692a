"""`refengine bench` on the CPU with quick settings (the tiny pairs, concurrency 1,2, a few tokens, 1 repeat):
the JSON shape (rows for plain / dflash / adaptive at each concurrency, their fields, acceptance labels),
that a rejected request fails the run (exit 2 and a message), that a profile run labels every speculating
row and reproduces the profile's tau, the bundled prompt sets, and the HF peer row.

Run: python -m pytest tests/unit/test_bench.py -q
"""

from __future__ import annotations

import json

import pytest

from refengine.bench.prompts import make_prompts
from refengine.cli import main
from refengine.defaults import RANDOM_PAIR, TRAINED_PAIR

QUICK = ["bench", "--device", "cpu", "--concurrency", "1,2", "--prompt-len", "8", "--repeats", "1"]
RANDOM = ["--target", str(RANDOM_PAIR / "target"), "--draft", str(RANDOM_PAIR / "draft")]
COMMON = {
    "mode",
    "acceptance",
    "concurrency",
    "tokens",
    "seconds",
    "tok_per_s",
    "per_request_tok_per_s",
    "memory_bound_floor_tok_per_s",
    "x_plain_floor",
    "repeats",
    "tok_per_s_min",
    "tok_per_s_max",
}
ENGINE = COMMON | {"host_ms_per_step", "steps"}
SPEC = ENGINE | {"tau", "draft_ms_per_step", "verify_ms_per_step", "x_own_ideal", "accepted_hist", "span_hist"}


def _bench(capsys, *argv: str) -> tuple[int, dict | None, str]:
    rc = main([*QUICK, *argv])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return rc, (json.loads(lines[-1]) if rc == 0 else None), err


def test_bench_json_shape(capsys, tmp_path):
    path = tmp_path / "bench.json"
    rc, res, err = _bench(capsys, *RANDOM, "--output-tokens", "6", "--output", str(path))
    assert rc == 0, err
    assert json.loads(path.read_text()) == res
    rows = res["rows"]
    assert {(r["mode"], r["concurrency"]) for r in rows} == {
        (m, c) for m in ("plain", "dflash", "adaptive") for c in (1, 2)
    }
    for r in rows:
        want = ENGINE if r["mode"] == "plain" else SPEC
        assert want <= set(r), f"{r['mode']} row lacks {sorted(want - set(r))}"
        assert r["tokens"] == 6 * r["concurrency"] and r["tok_per_s"] > 0
        assert r["acceptance"] == ("-" if r["mode"] == "plain" else "real drafter")
    assert "policy" in next(r for r in rows if r["mode"] == "adaptive")
    assert "x own ideal" in err and "adaptive" in err  # the table on stderr
    assert res["copy_bandwidth_bytes_per_s"] > 0 and res["target_weight_bytes"] > 0


def test_bench_fails_loudly_when_a_request_is_rejected(capsys):
    rc, _, err = _bench(capsys, *RANDOM, "--output-tokens", "8", "--max-model-len", "10", "--modes", "plain")
    assert rc == 2
    assert "rejected" in err and "context_length" in err, err


def test_bench_profile_rows_are_labelled_and_reproduce_tau(capsys):
    # tau2.5: every step accepts 1 or 2 drafts (half each). 2 requests x 60 tokens make ~47 draws; spans are
    # never truncated below 3 except on the last step, so the measured tau is within 0.3 of 2.5.
    rc, res, err = _bench(
        capsys,
        *RANDOM,
        "--output-tokens",
        "60",
        "--concurrency",
        "2",
        "--modes",
        "plain,dflash",
        "--acceptance-profile",
        "tau2.5",
    )
    assert rc == 0, err
    assert res["profiles"]["tau2.5"]["tau"] == 2.5
    spec = [r for r in res["rows"] if r["mode"] != "plain"]
    assert spec and all(r["acceptance"] == "profile tau2.5" for r in spec)
    assert "profile tau2.5" in err
    for r in spec:
        assert abs(r["tau"] - 2.5) <= 0.3, r


def test_bundled_prompt_sets():
    target = TRAINED_PAIR / "target"
    for kind in ("code", "prose", "chat", "mixed"):
        ps = make_prompts(kind, 5, 32, 4096, target)
        assert len(ps) == 5 and all(0 < len(p) <= 32 for p in ps), kind
    assert make_prompts("mixed", 3, 32, 4096, target) != make_prompts("code", 3, 32, 4096, target)
    with pytest.raises(Exception, match="no tokenizer.json"):
        make_prompts("code", 2, 32, 4096, RANDOM_PAIR / "target")


def test_bench_hf_peer_row(capsys):
    rc, res, err = _bench(
        capsys, *RANDOM, "--output-tokens", "4", "--concurrency", "2", "--modes", "plain", "--peer", "hf"
    )
    assert rc == 0, err
    (hf,) = [r for r in res["rows"] if r["mode"] == "hf"]
    assert hf["peer"].startswith("hf eager") and hf["tokens"] == 8 and COMMON <= set(hf)


def test_bench_plot_needs_matplotlib_or_writes_the_file(capsys, tmp_path):
    import importlib.util

    path = tmp_path / "bench.png"
    rc, _, err = _bench(capsys, *RANDOM, "--output-tokens", "3", "--concurrency", "1", "--plot", str(path))
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 2 and "matplotlib" in err and "refengine[plot]" in err, err
    else:
        assert rc == 0 and path.stat().st_size > 0, err
