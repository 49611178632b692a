"""The cell matrix of `refengine bench --sample-cells` (refengine/bench/cells.py, verdict.py, matrix.py): the
matrix's size and contents, Cell's validation, sample_cells (deterministic per seed, distinct cells in random
order, a clear error past the matrix's size), the verdicts on made-up numbers (ratio to the better mode,
unpaired by medians, paired round by round with the control, the worst cell, the bar), a pair's job (it pickles
to a fresh process; its engines sized for its largest concurrency), options the matrix refuses, and a CPU smoke
of `--sample-cells 2 --seed 15 --pairs tiny` asserting the JSON's structure, the per-cell log beside --output,
the settle and the paired branch.

Run: python -m pytest tests/unit/test_bench_matrix.py -q
"""

from __future__ import annotations

import json
import statistics

import pytest

from refengine.bench.cells import CONCURRENCIES, PAIRS, SETTLES_S, WORKLOADS, Cell, matrix, parse_pairs, sample_cells
from refengine.bench.job import ARRIVALS
from refengine.bench.run import BenchError
from refengine.bench.verdict import judge, needs_pairing, summarize, table, within
from refengine.cli import main
from refengine.spec_decode.acceptance_profile import parse_profile


def test_the_matrix_holds_every_combination_once():
    cells = matrix()
    assert len(cells) == 180 and len(set(cells)) == 180, len(cells)
    want = {
        (pair, w, c, a, s)
        for pair in PAIRS
        for w in WORKLOADS[pair]
        for c in CONCURRENCIES
        for a in ARRIVALS
        for s in SETTLES_S
    }
    assert {(c.pair, c.workload, c.concurrency, c.arrivals, c.settle_s) for c in cells} == want
    assert set(WORKLOADS["qwen3-4b"]) == {"tau1.0", "tau1.3", "tau3", "tau6.5", "sharegpt"}
    assert set(WORKLOADS["tiny"]) == {"code", "prose", "chat", "mixed"}
    assert CONCURRENCIES == (1, 8, 16, 32, 64) and SETTLES_S == (0.0, 15.0) and set(ARRIVALS) == {"wave", "steady"}
    taus = {w: round(parse_profile(w).tau, 2) for w in WORKLOADS["qwen3-4b"]}  # every profile parses
    assert taus["tau1.0"] == 1.0 and taus["tau6.5"] == 6.5 and 2 < taus["sharegpt"] < 2.5, taus
    assert len(matrix(("tiny",))) == 80 and len(matrix(("qwen3-4b",))) == 100
    four_b = next(c for c in cells if c.pair == "qwen3-4b")
    tiny = next(c for c in cells if c.pair == "tiny")
    assert (four_b.profile, four_b.prompts) == (four_b.workload, "random")
    assert (tiny.profile, tiny.prompts) == (None, tiny.workload)
    assert parse_pairs("tiny, qwen3-4b") == ("qwen3-4b", "tiny")
    with pytest.raises(BenchError, match="--pairs 'llama'"):
        parse_pairs("llama")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"pair": "llama"}, "cell pair 'llama'"),
        ({"workload": "code"}, "workload 'code' for pair qwen3-4b"),
        ({"concurrency": 0}, "concurrency 0"),
        ({"concurrency": 2.5}, "concurrency 2.5"),
        ({"arrivals": "burst"}, "arrivals 'burst'"),
        ({"settle_s": -1.0}, "settle -1.0"),
    ],
)
def test_a_cell_is_validated_at_construction(kw, match):
    good = {"pair": "qwen3-4b", "workload": "tau3", "concurrency": 8, "arrivals": "wave", "settle_s": 0.0}
    assert Cell(**good).label == "qwen3-4b/tau3 c8 wave settle0"
    with pytest.raises(BenchError, match=match):
        Cell(**{**good, **kw})


def test_sample_cells_is_seeded_distinct_and_in_random_order():
    a, b = sample_cells(24, 7), sample_cells(24, 7)
    assert a == b, "the same seed must draw the same cells in the same order"
    assert len(set(a)) == 24 and set(a) <= set(matrix())
    assert sample_cells(24, 8) != a, "another seed drew the same sample"
    everything = sample_cells(180, 3)
    assert set(everything) == set(matrix()) and everything != matrix(), "a full sample is the matrix reordered"
    assert {c.pair for c in sample_cells(20, 1, ("tiny",))} == {"tiny"}
    with pytest.raises(BenchError, match=r"--sample-cells 81: the matrix of tiny has 80 cells; give 1 to 80"):
        sample_cells(81, 1, ("tiny",))
    with pytest.raises(BenchError, match="give 1 to 180"):
        sample_cells(0, 1)


def test_within_is_ten_percent_of_the_smaller():
    assert within(100.0, 110.0) and within(110.0, 100.0) and not within(100.0, 110.5)


def test_an_unpaired_cell_is_adaptive_median_over_the_better_median():
    # dflash is clearly better (about 2x plain): medians plain 100, dflash 200, adaptive 190 -> 0.95
    rounds = [
        {"plain": 100.0, "dflash": 200.0, "adaptive": 190.0},
        {"plain": 110.0, "dflash": 210.0, "adaptive": 195.0},
        {"plain": 90.0, "dflash": 190.0, "adaptive": 185.0},
    ]
    assert not needs_pairing(rounds)
    v = judge(rounds, bar=0.95)
    assert (v["ratio"], v["better"], v["paired"], v["passes"]) == (0.95, "dflash", False, True), v
    assert (v["plain_tok_per_s"], v["dflash_tok_per_s"], v["adaptive_tok_per_s"]) == (100.0, 200.0, 190.0), v
    assert "control_x_plain" not in v and not judge(rounds, bar=0.96)["passes"]


def test_a_paired_cell_is_the_median_of_each_rounds_ratio_with_the_control():
    # plain and dflash within 10% (medians 100 / 105): the ratio is per round, adaptive / max(plain, dflash) of
    # that round: 100/105, 118/120, 92/95 -> median 0.9684; by medians it would be 100 / 105 = 0.9524
    screen = [
        {"plain": 100.0, "dflash": 105.0, "adaptive": 100.0},
        {"plain": 120.0, "dflash": 110.0, "adaptive": 118.0},
    ]
    assert needs_pairing(screen)
    rounds = [*screen, {"plain": 90.0, "dflash": 95.0, "adaptive": 92.0, "control": 91.0}]
    rounds.append({"plain": 100.0, "dflash": 100.0, "adaptive": 99.0, "control": 98.0})
    v = judge(rounds, bar=0.95)
    ratios = [100 / 105, 118 / 120, 92 / 95, 99 / 100]
    assert v["paired"] and v["rounds"] == 4, v
    assert v["ratio"] == pytest.approx(statistics.median(ratios), abs=1e-4), (v["ratio"], ratios)
    lo, hi = v["ratio_iqr"]
    assert min(ratios) <= lo <= v["ratio"] <= hi <= max(ratios), v
    assert v["control_x_plain"] == pytest.approx(statistics.median([91 / 90, 0.98]), abs=1e-4), v
    assert v["passes"]
    with pytest.raises(ValueError, match="lacks"):
        judge([{"plain": 1.0, "dflash": 1.0}])


def test_summary_names_the_worst_cell_and_whether_the_bar_holds():
    cells = [
        {"index": 0, "label": "a", "ratio": 1.2, "paired": False, "better": "dflash", "rows": {}},
        {"index": 1, "label": "b", "ratio": 0.94, "paired": True, "better": "plain", "rows": {}},
        {"index": 2, "label": "c", "ratio": 0.97, "paired": False, "better": "plain", "rows": {}},
    ]
    s = summarize(cells, bar=0.95)
    assert s["worst"]["label"] == "b" and s["worst"]["ratio"] == 0.94 and "rows" not in s["worst"], s
    assert s["bar_holds"] is False and s["failing"] == ["b"], s
    s = summarize(cells, bar=0.94)
    assert s["bar_holds"] is True and s["failing"] == [], s


def test_the_table_shows_each_cell_and_its_verdict():
    rounds = [{"plain": 100.0, "dflash": 104.0, "adaptive": 90.0, "control": 101.0}]
    cell = {"index": 0, "label": "tiny/code c8 wave settle0", **judge(rounds)}
    text = table([cell], 0.95)
    line = text.splitlines()[-1]
    assert "tiny/code c8 wave settle0" in line and "0.865" in line and "FAIL" in line, text
    assert "1.010" in line and "yes" in line, text  # the control over plain, paired


def test_bench_sample_cells_on_the_cpu(capsys, monkeypatch, tmp_path):
    """`--sample-cells 2 --seed 15 --pairs tiny` (a c8 steady cell settled 0 s and a c1 wave cell settled 15 s):
    the JSON's fields, each cell's three modes and ratio, the settle (adaptive alone, the cell's seconds and
    arrivals; recorded, not waited for) and the paired branch (forced for the first cell: the control loads
    and four more rounds run with it)."""
    import refengine.bench.matrix as m

    settles: list[tuple[str, int, float, int | None]] = []

    def settle(engine, batch, seconds, tokens, in_flight=None):
        settles.append((engine.span_stats()["policy"], len(batch), seconds, in_flight))

    pairings = iter([True, False])
    monkeypatch.setattr(m, "settle_engine", settle)
    monkeypatch.setattr(m, "needs_pairing", lambda rounds: next(pairings))
    argv = ["bench", "--sample-cells", "2", "--seed", "15", "--pairs", "tiny", "--device", "cpu"]
    output = tmp_path / "m.json"
    rc = main([*argv, "--prompt-len", "8", "--output-tokens", "3", "--repeats", "1", "--output", str(output)])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    res = json.loads(out.strip().splitlines()[-1])
    logged = [json.loads(line) for line in (tmp_path / "m.json.cells.jsonl").read_text().splitlines()]
    assert logged == res["cells"], "the cells' log beside --output differs from the JSON's cells"
    expected = sample_cells(2, 15, ("tiny",))
    assert [c["label"] for c in res["cells"]] == [c.label for c in expected], res["cells"]
    assert [c.label for c in expected] == ["tiny/prose c8 steady settle0", "tiny/code c1 wave settle15"]
    assert (res["seed"], res["sample_cells"], res["pairs"], res["matrix_cells"]) == (15, 2, ["tiny"], 80)
    assert res["output_tokens"] == 3 and res["repeats"] == 1 and res["bar"] == 0.95
    assert settles == [("adaptive", 32, 0.0, 8), ("adaptive", 1, 15.0, None)], settles
    paired, plain = res["cells"]
    for cell in res["cells"]:
        rates = [cell[f"{mode}_tok_per_s"] for mode in ("plain", "dflash", "adaptive")]
        assert min(rates) > 0 and cell["passes"] == (cell["ratio"] >= 0.95), cell
        assert set(cell["rows"]) >= {"plain", "dflash", "adaptive"}, cell["rows"].keys()
        assert cell["rows"]["adaptive"]["spans"]["policy"] == "adaptive", cell["rows"]["adaptive"]["spans"]
        assert cell["rows"]["dflash"]["acceptance"] == "real drafter"
    assert plain["paired"] is False and plain["rounds"] == 1 and "control" not in plain["rows"], plain
    better = max(plain["plain_tok_per_s"], plain["dflash_tok_per_s"])
    assert plain["ratio"] == pytest.approx(plain["adaptive_tok_per_s"] / better, rel=1e-3), plain
    assert paired["paired"] is True and paired["rounds"] == 1 + 4 and paired["rows"]["control"]["repeats"] == 4
    assert paired["rows"]["plain"]["concurrency"] == 8 and paired["rows"]["plain"]["repeats"] == 5, paired["rows"]
    assert "control_x_plain" in paired and len(paired["control_iqr"]) == 2, paired
    assert set(res["engines"]["tiny"]["graph_captures"]) == {"plain", "dflash", "adaptive", "control"}
    worst = min(res["cells"], key=lambda c: c["ratio"])
    assert res["worst"]["label"] == worst["label"] and res["bar_holds"] == all(c["passes"] for c in res["cells"])
    assert "seed 15" in err and "[1/2] tiny/prose c8 steady settle0" in err and "worst:" in err, err[-1500:]


def test_a_pairs_job_pickles_and_sizes_its_engines_for_its_largest_concurrency():
    """On CUDA each pair's cells run in a fresh process (matrix.measure_pair, spawned): the job and the function
    must pickle; its engines' KV pool holds the pair's largest sampled concurrency at the run's context."""
    import pickle

    from refengine.bench.matrix import PairJob, measure_pair
    from refengine.config import DEFAULT_PAGE_SIZE
    from refengine.kv.pool import blocks_for

    cells = ((0, Cell("qwen3-4b", "tau3", 8, "wave", 0.0)), (3, Cell("qwen3-4b", "sharegpt", 64, "steady", 15.0)))
    job = PairJob("qwen3-4b", cells, 4, "cuda", 128, 64, 3, 5, None, 3e12, 0.95)
    assert pickle.loads(pickle.dumps(job)) == job and pickle.loads(pickle.dumps(measure_pair)) is measure_pair
    j = job.mode_job()
    assert j.concurrency == (8, 64) and j.synthetic and j.target.endswith("qwen3-4b"), j
    assert j.context == 128 + 64 + 16 and j.blocks == 64 * blocks_for(j.context, DEFAULT_PAGE_SIZE), j


def test_bench_sample_cells_refuses_options_the_matrix_sets(capsys):
    rc = main(["bench", "--sample-cells", "2", "--concurrency", "1", "--device", "cpu"])
    assert rc == 2 and "--concurrency does not apply" in capsys.readouterr().err
    rc = main(["bench", "--pairs", "tiny", "--device", "cpu"])
    assert rc == 2 and "--pairs applies to the cell matrix" in capsys.readouterr().err
    rc = main(["bench", "--sample-cells", "500", "--pairs", "tiny", "--device", "cpu", "--seed", "1"])
    assert rc == 2 and "give 1 to 80" in capsys.readouterr().err
