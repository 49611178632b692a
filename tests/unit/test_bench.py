"""`refengine bench` on the CPU with quick settings (the tiny pairs, concurrency 1,2, a few tokens, 1 repeat):
the JSON shape (rows for plain / dflash / adaptive at each concurrency, their fields, acceptance labels, the
steps and wall time by step kind, the span policy's record), that a rejected request fails the run (exit 2 and
a message), that unknown modes are refused, that a profile run labels every speculating row and reproduces the
profile's tau, that a run in which a span policy's choice raised (Engine.span_stats' errors grew) fails too,
that each mode's engine runs alone
(freed before the next loads; plain once per concurrency) and settles with runs of the measured length (a short
--output-tokens fits its context cap), the paired method (rounds in a balanced order, ratios to
plain in the same round, the control), steady arrivals (c requests in flight), the bundled prompt sets, and the
HF peer row, and that --fused-ops reaches every engine.

Run: python -m pytest tests/unit/test_bench.py -q
"""

from __future__ import annotations

import json

import pytest

from refengine.bench.prompts import make_prompts
from refengine.bench.run import BenchError
from refengine.cli import main
from refengine.defaults import RANDOM_PAIR, TRAINED_PAIR
from refengine.plan import PLAN_KINDS
from tests.adapter import first_divergence

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
        # where the run's time went, by step kind: every step counted once, within the run's wall time
        kinds = {k for k in PLAN_KINDS if r.get(f"{k}_steps")}  # (verify_steps 0: a run that never verified)
        assert sum(r[f"{k}_steps"] for k in kinds) == r["steps"], r
        assert 0 < sum(r[f"{k}_wall_ms"] for k in kinds) <= r["seconds"] * 1e3, r
        # (dflash: a step whose every budget is down to one token decodes, recording the rows' features)
        allowed = {"plain": {"prefill", "decode"}, "dflash": {"prefill", "verify", "decode_taps"}}.get(
            r["mode"], set(PLAN_KINDS)
        )
        assert "prefill" in kinds and kinds <= allowed, (r["mode"], kinds)
    for r in rows:  # the span policy's record (Engine.span_stats), its counts over the row's last run
        if r["mode"] == "plain":
            assert "spans" not in r, r["spans"]
            continue
        spans = r["spans"]
        assert spans["policy"] == ("fixed" if r["mode"] == "dflash" else "adaptive") and spans["errors"] == 0, spans
        assert spans["spans"] and all(int(k) >= 1 and v > 0 for k, v in spans["spans"].items()), spans
    assert "x own ideal" in err and "adaptive" in err  # the table on stderr
    assert res["copy_bandwidth_bytes_per_s"] > 0 and res["target_weight_bytes"] > 0


def test_bench_fails_loudly_when_a_request_is_rejected(capsys):
    rc, _, err = _bench(capsys, *RANDOM, "--output-tokens", "8", "--max-model-len", "10", "--modes", "plain")
    assert rc == 2
    assert "rejected" in err and "context_length" in err, err


def test_bench_fails_loudly_when_the_span_policy_raises():
    """The engine decodes a step whose span choice raised plainly and goes on, counting it in span_stats()'s
    `errors`; a bench run in which that count grew measured something else than the policy, so it fails with a
    message (and one whose count did not grow runs, whatever the count before it)."""
    from refengine.bench.run import engine_for, run_once

    engine = engine_for(
        "adaptive", str(RANDOM_PAIR / "target"), str(RANDOM_PAIR / "draft"), device="cpu", synthetic=False,
        max_num_seqs=2, max_model_len=64, override=None,
    )  # fmt: skip
    stats = engine.span_stats
    raised = [3]  # errors before the run: an earlier run's, not this one's

    def span_stats():
        return {**stats(), "errors": raised[0]}

    engine.span_stats = span_stats
    run_once(engine, [[5, 6, 7, 8]], 4)  # the count did not grow: a measurement
    step = engine.step

    def failing_step():  # as if one of the run's choices raised
        raised[0] = 4
        return step()

    engine.step = failing_step
    with pytest.raises(BenchError, match="adaptive span policy's choice raised 1 times"):
        run_once(engine, [[5, 6, 7, 8], [9, 10, 11]], 6)
    assert not engine.has_work()


def test_bench_speculation_measures_plain_and_that_policy(capsys):
    rc, res, err = _bench(capsys, *RANDOM, "--output-tokens", "3", "--concurrency", "1", "--speculation", "adaptive")
    assert rc == 0, err
    rows = {r["mode"]: r for r in res["rows"]}
    assert sorted(rows) == ["adaptive", "plain"], sorted(rows)
    assert rows["adaptive"]["spans"]["policy"] == "adaptive"
    rc, _, err = _bench(capsys, *RANDOM, "--speculation", "fixed", "--modes", "plain")
    assert rc == 2 and "give --modes or --speculation, not both" in err, err[-300:]


def test_bench_fused_ops_reach_the_engines(capsys, monkeypatch):
    """--fused-ops names the kernels every mode's engine is built with (EngineConfig.fused_ops, 'none' for
    none); the JSON records the kernels that ran (none on the CPU, where the torch ops run); unknown names are
    refused before any model loads."""
    from refengine.engine import Engine

    built = []
    init = Engine.__init__

    def spy(self, config, **kw):
        built.append(config.fused_ops)
        init(self, config, **kw)

    monkeypatch.setattr(Engine, "__init__", spy)
    for arg, want in (("rmsnorm,pre_attn", ("rmsnorm", "pre_attn")), ("none", ())):
        built.clear()
        rc, res, err = _bench(capsys, *RANDOM, "--output-tokens", "2", "--concurrency", "1", "--fused-ops", arg)
        assert rc == 0, err
        assert built and set(built) == {want}, built
        assert res["fused_ops"] == [], res["fused_ops"]
    with pytest.raises(SystemExit) as exc:
        main([*QUICK, *RANDOM, "--fused-ops", "rope,bogus"])
    assert exc.value.code == 2
    assert "bogus: use a subset of" in capsys.readouterr().err


def test_bench_refuses_unknown_modes(capsys):
    rc, _, err = _bench(capsys, *RANDOM, "--modes", "plain,adaptive-shadow")
    assert rc == 2 and "--modes 'plain,adaptive-shadow': use a subset of plain,dflash,adaptive" in err, err[-300:]


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


def test_bench_runs_one_engine_at_a_time(monkeypatch):
    """Each mode's engine is loaded alone: every run of one mode (all cells) before the next mode's engine is
    built, the previous engine freed by then; plain measured once per concurrency, not once per profile; each
    profile's cells together, adaptive settled again under each later profile (its estimates learn it)."""
    import gc
    import weakref

    import refengine.bench.loading as loading
    import refengine.bench.suite as suite

    order: list[tuple[str, str, int]] = []
    alive_at_build: list[int] = []
    built: list[weakref.ref] = []
    measure, make = suite.measure_row, loading.engine_for

    def spy(engine, mode, label, batch, *rest):
        order.append((mode, label, len(batch)))
        return measure(engine, mode, label, batch, *rest)

    def build(*args, **kw):
        gc.collect()
        alive_at_build.append(sum(r() is not None for r in built))
        e = make(*args, **kw)
        built.append(weakref.ref(e))
        return e

    settle = suite.settle_engine
    lengths: list[int] = []  # the settle runs' new tokens per settle call

    def settled(engine, batch, seconds, tokens):
        order.append(("settle", "adaptive" if engine.span_stats()["policy"] == "adaptive" else "-", len(batch)))
        lengths.append(tokens)
        return settle(engine, batch, seconds, tokens)

    monkeypatch.setattr(suite, "measure_row", spy)
    monkeypatch.setattr(loading, "engine_for", build)
    monkeypatch.setattr(suite, "settle_engine", settled)
    res = suite.bench(
        str(RANDOM_PAIR / "target"),
        str(RANDOM_PAIR / "draft"),
        device="cpu",
        synthetic=False,
        concurrency=[1, 2],
        prompt_len=8,
        output_tokens=3,
        repeats=2,
        profiles=["tau1", "tau3"],
    )
    assert alive_at_build == [0, 0, 0], f"engines still alive when the next was built: {alive_at_build}"
    plain = [("plain", "-", c) for c in (1, 2) for _ in range(2)]
    tau1, tau3 = ([("?", f"profile {p}", c) for c in (1, 2) for _ in range(2)] for p in ("tau1", "tau3"))
    dflash, adaptive = ([(m, *x[1:]) for x in tau1 + tau3] for m in ("dflash", "adaptive"))
    expected = [("settle", "-", 2), *plain, ("settle", "-", 2), *dflash, ("settle", "adaptive", 2)]
    expected += adaptive[:4] + [("settle", "adaptive", 2)] + adaptive[4:]
    assert order == expected, f"first difference at run {first_divergence(order, expected)}"
    assert lengths == [3] * len(lengths), f"settle runs of {lengths} tokens: the measured runs generate 3"
    rows = [r for r in res["rows"] if r["mode"] == "plain"]
    assert len(rows) == 2 and all(r["repeats"] == 2 for r in rows)
    assert res["kv_blocks_per_engine"] > 0 and res["settle_s"] == 0.0
    assert res["method"].startswith("one engine at a time")


def test_bench_settles_with_runs_of_the_measured_length(capsys):
    """The settle's runs generate --output-tokens, as the measured runs do: a fixed longer length (32, say) would
    overrun the engine's context cap (prompt + output tokens + 16) whenever --output-tokens is under 16, and the
    bench would fail with a rejected request whenever it settles (on CUDA, always)."""
    rc = main(
        [*QUICK, *RANDOM, "--output-tokens", "3", "--settle-s", "0.2", "--no-isolate", "--modes", "plain,adaptive"]
    )
    err = capsys.readouterr().err
    assert rc == 0, f"exit {rc}: {err[-400:]}"


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


def test_aggregate_takes_medians_of_fields_some_runs_lack():
    """A repeat without a field (decode ms when it ran no decode plan) must not leave the row at the last run's
    raw value or drop the field: the median is over the runs that have it."""
    from refengine.bench.report import aggregate

    runs = [
        {"concurrency": 8, "tok_per_s": 30.0, "spans": {"a": 1}},
        {"concurrency": 8, "tok_per_s": 10.0, "decode_ms_per_step": 4.0, "spans": {"a": 2}},
        {"concurrency": 8, "tok_per_s": 20.0, "decode_ms_per_step": 6.0, "spans": {"a": 3}},
    ]
    row = aggregate(runs)
    assert row["tok_per_s"] == 20.0 and (row["tok_per_s_min"], row["tok_per_s_max"]) == (10.0, 30.0), row
    assert row["decode_ms_per_step"] == 5.0, row
    assert row["spans"] == {"a": 3} and row["concurrency"] == 8 and row["repeats"] == 3, row


def test_bench_isolated_modes_match_in_process():
    """`isolate=True` (the CUDA default) measures each mode in a fresh process: the same rows (tokens, tau
    under a profile) as in-process, and the JSON says which method ran."""
    import refengine.bench.suite as suite

    kw = dict(
        device="cpu",
        synthetic=False,
        concurrency=[2],
        prompt_len=8,
        output_tokens=4,
        repeats=1,
        modes=("plain", "dflash"),
        profiles=["tau2.5"],
    )
    pair = (str(RANDOM_PAIR / "target"), str(RANDOM_PAIR / "draft"))
    iso, inproc = suite.bench(*pair, isolate=True, **kw), suite.bench(*pair, isolate=False, **kw)
    assert iso["method"] == suite.METHOD_ISOLATED and inproc["method"] == suite.METHOD_IN_PROCESS

    def rows(res):
        return {(r["mode"], r["acceptance"], r["concurrency"]): (r["tokens"], r.get("tau")) for r in res["rows"]}

    assert rows(iso) == rows(inproc) and len(rows(iso)) == 2, (rows(iso), rows(inproc))
    assert iso["graph_captures"].keys() == {"plain", "dflash"} and iso["drafter_weight_bytes"] > 0


def test_bench_processes_rounds_list_each_processs_median():
    """`processes=2`: each mode measured in two fresh processes (modes taking turns); a row's medians are over
    both processes' runs and it lists each process's median tok/s (paired: each process's median ratio to
    plain). Several processes need isolation."""
    import refengine.bench.suite as suite

    kw = dict(device="cpu", synthetic=False, concurrency=[1], prompt_len=8, output_tokens=3, repeats=1)
    pair = (str(RANDOM_PAIR / "target"), str(RANDOM_PAIR / "draft"))
    res = suite.bench(*pair, modes=("plain", "dflash"), isolate=True, processes=2, **kw)
    assert res["processes"] == 2 and len(res["rows"]) == 2, res["rows"]
    for row in res["rows"]:
        assert row["repeats"] == 2 and len(row["process_tok_per_s"]) == 2, row
        assert row["tok_per_s_min"] <= min(row["process_tok_per_s"]) <= max(row["process_tok_per_s"])
        assert max(row["process_tok_per_s"]) <= row["tok_per_s_max"], row
    with pytest.raises(BenchError, match="processes=2"):
        suite.bench(*pair, modes=("plain",), isolate=False, processes=2, **kw)
    # --paired in fresh processes: one process per round holds every engine; its rows list each one's ratio
    res = suite.bench(*pair, modes=("plain", "dflash"), isolate=True, processes=2, paired=True, **kw)
    ratios = {r["acceptance"]: r.get("process_paired_x_plain") for r in res["rows"]}
    assert len(res["rows"]) == 3 and ratios["-"] is None, res["rows"]
    assert all(len(v) == 2 for k, v in ratios.items() if k != "-"), ratios


def test_bench_cli_isolate_runs_each_mode_in_a_fresh_process():
    """`python -m refengine bench --isolate` (the CUDA default, forced here on the CPU): spawned processes
    re-import the entry point, which must not run the CLI again; the JSON says the isolated method ran."""
    import os
    import subprocess
    import sys

    from refengine.bench.suite import METHOD_ISOLATED

    argv = ["bench", "--device", "cpu", "--concurrency", "1", "--prompt-len", "8", "--output-tokens", "3"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "refengine", *argv, "--repeats", "1", "--isolate"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["method"] == METHOD_ISOLATED and {r["mode"] for r in res["rows"]} == {"plain", "dflash", "adaptive"}


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_paired_round_orders_balance_places_and_predecessors(n):
    """round_order over a cycle: each engine in each place, and right after each other engine, equally often
    (with the order only rotating, each engine always followed the same one)."""
    from collections import Counter

    from refengine.bench.paired import order_cycle, round_order

    names = [f"e{i}" for i in range(n)]
    cycle = [round_order(names, r) for r in range(order_cycle(n))]
    assert all(sorted(o) == names for o in cycle), cycle
    places = Counter((i, e) for o in cycle for i, e in enumerate(o))
    after = Counter((a, b) for o in cycle for a, b in zip(o, o[1:]))
    assert set(places.values()) == {len(cycle) // n} and len(places) == n * n, f"places {places}"
    assert set(after.values()) == {len(cycle) // n} and len(after) == n * (n - 1), f"predecessors {after}"
    assert round_order(names, len(cycle)) == cycle[0], "the design repeats after a cycle"


def test_bench_paired_rounds_are_balanced_and_ratio_to_plain_in_the_same_round(capsys, monkeypatch):
    """`--paired`: plain, a second plain engine (the control) and each mode in one process; every round runs
    each engine once, in round_order's balanced order; each run's paired_x_plain is its tok/s over plain's run in
    the same round, a row's is the median with the interquartile range; plain and the control run in every
    profile's rounds; --paired without plain fails with a message."""
    import statistics

    import refengine.bench.paired as paired

    seen: list[tuple[str, str, int, float]] = []
    targets: set[int] = set()  # the engines' targets: one shared copy of the weights (--own-weights: one each)
    measure = paired.measure_row

    def spy(engine, mode, label, batch, *rest):
        row = measure(engine, mode, label, batch, *rest)
        seen.append((mode, label, len(batch), row["tok_per_s"]))
        targets.add(id(engine.target))
        return row

    monkeypatch.setattr(paired, "measure_row", spy)
    argv = [*RANDOM, "--paired", "--modes", "plain,adaptive", "--acceptance-profile", "tau1,tau3"]
    rc, res, err = _bench(capsys, *argv, "--output-tokens", "4", "--repeats", "3")
    assert rc == 0 and res is not None and res["method"] == paired.METHOD_PAIRED, err[-2000:]
    assert res["weights"] == "shared" and len(targets) == 1, (res.get("weights"), len(targets))
    names = [("plain", "-"), ("plain", paired.CONTROL)]
    rounds = [seen[i : i + 3] for i in range(0, len(seen), 3)]
    assert len(rounds) == 2 * 2 * 3, f"{len(rounds)} rounds: 2 profiles x 2 concurrencies x 3 repeats"
    for k, rnd in enumerate(rounds):
        profile = ("tau1", "tau3")[k // 6]
        engines = [*names, ("adaptive", f"profile {profile}")]
        assert [x[:2] for x in rnd] == paired.round_order(engines, k % 3), f"round {k}: {rnd}"
    assert res["rounds_balanced"] is False, "3 repeats of 3 engines: the design's cycle is 6 rounds"
    rows = {(r["mode"], r["acceptance"], r["concurrency"]): r for r in res["rows"]}
    for c in (1, 2):
        assert rows[("plain", "-", c)]["repeats"] == 6 and "paired_x_plain" not in rows[("plain", "-", c)]
        for key in (("plain", paired.CONTROL, c), ("adaptive", "profile tau1", c), ("adaptive", "profile tau3", c)):
            row = rows[key]
            ratios = sorted(
                x[3] / p[3]
                for rnd in rounds
                for x in rnd
                for p in rnd
                if x[:3] == key and p[:2] == names[0] and p[2] == c
            )
            assert len(ratios) == row["repeats"] and row["paired_x_plain"] == pytest.approx(
                statistics.median(ratios), abs=1e-3
            )
            lo, hi = row["paired_x_plain_iqr"]
            assert lo <= row["paired_x_plain"] <= hi, row
    assert "x plain paired (IQR)" in err and res["graph_captures"].keys() == {"plain", "control", "adaptive"}
    targets.clear()
    argv = [*RANDOM, "--paired", "--own-weights", "--modes", "plain,dflash", "--output-tokens", "2", "--repeats", "1"]
    rc, res, err = _bench(capsys, *argv)
    assert rc == 0 and res is not None and res["weights"] == "one copy per engine" and len(targets) == 3, err[-500:]
    rc, _, err = _bench(capsys, *RANDOM, "--paired", "--modes", "adaptive", "--output-tokens", "2")
    assert rc == 2 and "add plain to --modes" in err, err[-500:]


def test_bench_steady_arrivals_keep_c_requests_in_flight(capsys, monkeypatch):
    """`--arrivals steady`: a cell's run submits STEADY_ROUNDS x c requests, c of them at first (their budgets
    spread over the output length) and the next one as one finishes, so at most c are ever unfinished and the
    row's concurrency is c; waves (the default) submit the cell's c requests together. The JSON says which; the
    HF peer (waves of generate) is refused with it."""
    from collections import Counter

    from refengine.bench import run as bench_run
    from refengine.bench.job import STEADY_ROUNDS

    submitted: list[tuple[int, int]] = []  # (run, unfinished requests after this submission)
    live: list = []
    runs = [0]
    once = bench_run.run_once

    def spy_run_once(engine, prompts, output_tokens, in_flight=None, temperature=0.0):
        runs[0] += 1
        live.clear()
        add = engine.add_request

        def spy_add(prompt, params):
            req = add(prompt, params)
            live.append(req)
            submitted.append((runs[0], sum(not r.finished for r in live)))
            return req

        monkeypatch.setattr(engine, "add_request", spy_add)
        try:
            return once(engine, prompts, output_tokens, in_flight, temperature)
        finally:
            monkeypatch.setattr(engine, "add_request", add)

    monkeypatch.setattr(bench_run, "run_once", spy_run_once)
    monkeypatch.setattr("refengine.bench.suite.run_once", spy_run_once)
    argv = [*RANDOM, "--modes", "plain", "--concurrency", "2", "--output-tokens", "3", "--repeats", "2"]
    rc, res, err = _bench(capsys, *argv, "--arrivals", "steady")
    assert rc == 0 and res is not None, err[-2000:]
    assert res["arrivals"].startswith("steady"), res["arrivals"]
    per_run = Counter(r for r, _ in submitted)  # run -> requests submitted
    measured = [k for k, n in per_run.items() if n == 2 * STEADY_ROUNDS]
    assert len(measured) == 2, f"runs of {2 * STEADY_ROUNDS} requests: {measured}, requests a run {dict(per_run)}"
    worst = max(n for r, n in submitted if r in measured)
    assert worst <= 2, f"{worst} requests unfinished at once with --concurrency 2"
    (row,) = res["rows"]
    # the first two in flight run budgets spread over (0, 3]: 2 and 3 tokens (steady_budgets), the rest 3 each
    assert row["concurrency"] == 2 and row["tokens"] == 2 + 3 + (2 * STEADY_ROUNDS - 2) * 3, row
    rc, res, err = _bench(capsys, *argv)
    assert rc == 0 and res is not None and res["arrivals"] == "wave" and res["rows"][0]["tokens"] == 2 * 3, err[-500:]
    rc, _, err = _bench(capsys, *argv, "--arrivals", "steady", "--peer", "hf")
    assert rc == 2 and "--arrivals wave" in err, err[-500:]


def test_steady_budgets_spread_the_first_requests_in_flight():
    """The first c requests of a steady cell finish at evenly spread steps (so plain decode's arrivals spread out
    as speculation's do); the rest run the full output length."""
    from refengine.bench.job import steady_budgets

    got = steady_budgets(10, 4, 128)
    assert got == [32, 64, 96, 128, 128, 128, 128, 128, 128, 128], got
    assert steady_budgets(3, 8, 5) == [1, 2, 2], steady_budgets(3, 8, 5)  # fewer requests than in flight
    assert min(steady_budgets(32, 32, 3)) == 1, "every budget at least one token"
