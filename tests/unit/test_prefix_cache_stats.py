"""The prefix cache's numbers and switches: Engine.prefix_cache_stats counts requests, hits, looked-up and
cached prompt tokens and blocks exactly on a known schedule (and keeps hitting with DFlash on); the server's
/metrics exports them (refengine_prefix_cache_*); the planner's per-token `pending` term is exactly the
feature store's row, the rows cached blocks carry as a hit's drafter context; `--enable-prefix-caching`
reaches EngineConfig from `refengine generate`, `serve` and `bench`; EngineConfig validates the switch;
`refengine bench --workload shared-prefix | multi-turn` runs on the CPU with the tiny pair, cache on and off,
DFlash and plain. CPU, fp32.

Run: python -m pytest -q tests/unit/test_prefix_cache_stats.py
"""

from __future__ import annotations

import json
import weakref

import pytest
from prometheus_client.parser import text_string_to_metric_families

from refengine import EngineConfig, SamplingParams
from refengine.cli import build_parser, main
from refengine.defaults import TRAINED_PAIR
from refengine.errors import UnsupportedConfigError
from refengine.server.loop import EngineLoop
from refengine.server.metrics import render_metrics
from refengine.server.serve import engine_config
from tests.adapter import cpu_engine

SYSTEM = list(range(3, 43))  # 40 tokens: two whole blocks and 8 of a third
PROMPTS = [SYSTEM + [50 + i, 60 + i] for i in range(4)]


def _run(draft: bool):
    engine = cpu_engine(TRAINED_PAIR / "target", TRAINED_PAIR / "draft" if draft else None, enable_prefix_caching=True)
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8))
    engine.generate(PROMPTS[1:], SamplingParams(max_tokens=8))
    return engine


@pytest.mark.parametrize("draft", [True, False], ids=["dflash", "plain"])
def test_stats_count_a_known_schedule(draft):
    s = _run(draft).prefix_cache_stats()
    want = {"enabled": True, "queries": 4, "hits": 3, "query_tokens": 4 * 42, "hit_tokens": 3 * 32}
    got = {k: s[k] for k in want}
    assert got == want, f"stats {got}, want {want} (DFlash {'on' if draft else 'off'})"
    assert s["hit_rate"] == pytest.approx(96 / 168)
    # request 0 registered 3 blocks (49 committed tokens), each later one its own third block: 3 + 3
    assert s["inserted"] == s["cached_blocks"] == 6 == s["evictable_blocks"] and s["evicted"] == 0, s


def test_stats_off():
    engine = cpu_engine(TRAINED_PAIR / "target", TRAINED_PAIR / "draft")
    assert engine.prefix_cache_stats() == {"enabled": False}


def test_metrics_export_the_cache():
    engine = _run(draft=True)
    loop = EngineLoop(engine)  # not started: the snapshot is published by hand
    loop._publish_snapshot()
    got = {
        s.name: s.value
        for fam in text_string_to_metric_families(render_metrics(loop.snapshot, "m"))
        for s in fam.samples
        if s.name.startswith("refengine_prefix_cache")
    }
    want = {
        "refengine_prefix_cache_enabled": 1.0,
        "refengine_prefix_cache_queries_total": 4.0,
        "refengine_prefix_cache_hits_total": 3.0,
        "refengine_prefix_cache_query_tokens_total": 168.0,
        "refengine_prefix_cache_cached_tokens_total": 96.0,
        "refengine_prefix_cache_hit_rate": pytest.approx(96 / 168),
        "refengine_prefix_cache_blocks": 6.0,
        "refengine_prefix_cache_evicted_blocks_total": 0.0,
    }
    assert got == want, f"/metrics exported {got}"


def test_the_planner_bills_the_features_cached_blocks_carry():
    """A hit's drafter context is the cached blocks' rows of the feature store: one row per slot of the pool,
    cached or not, at exactly the reservation's per-token `pending` term."""
    from refengine.memory.reservation import DFlashMemoryReservation

    engine = _run(draft=True)
    res = DFlashMemoryReservation.from_config(TRAINED_PAIR / "target", TRAINED_PAIR / "draft", dtype_bytes=4)
    store, pool = engine.store, engine.pool
    assert store.bytes_per_token() == res.pending_features_bytes_per_token, (store.bytes_per_token(), res)
    slots = (pool.num_blocks + len(pool.dummy_blocks)) * pool.page_size
    assert store.rows.shape[0] == slots, f"store rows {store.rows.shape[0]} for {slots} pool slots"


def test_switch_reaches_the_config():
    with pytest.raises(UnsupportedConfigError, match="enable_prefix_caching"):
        EngineConfig("x", enable_prefix_caching=1)  # type: ignore[arg-type]
    base = ["serve", "--device", "cpu", "--model", str(TRAINED_PAIR / "target")]
    assert engine_config(build_parser().parse_args(base)).enable_prefix_caching is False
    assert engine_config(build_parser().parse_args([*base, "--enable-prefix-caching"])).enable_prefix_caching
    assert build_parser().parse_args(["generate", "--enable-prefix-caching"]).enable_prefix_caching
    assert build_parser().parse_args(["bench", "--enable-prefix-caching"]).enable_prefix_caching


QUICK = ["bench", "--device", "cpu", "--concurrency", "1,2", "--repeats", "1", "--output-tokens", "6"]
QUICK += ["--system-len", "40", "--question-len", "4", "--turns", "2"]


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_bench_workloads_cache_on_and_off(capsys, workload):
    rows = {}
    for cache in (False, True):
        rc = main([*QUICK, "--workload", workload, *(["--enable-prefix-caching"] if cache else [])])
        out, err = capsys.readouterr()
        assert rc == 0, err
        rows[cache] = json.loads(out.strip().splitlines()[-1])["rows"]
    for cache, rs in rows.items():
        assert [(r["mode"], r["concurrency"]) for r in rs] == [("plain", 1), ("plain", 2), ("dflash", 1), ("dflash", 2)]
        for r in rs:
            assert r["tok_per_s"] > 0 and 0 < r["ttft_ms_median"] <= r["ttft_ms_p90"], r
            assert (r["cached_token_share"] > 0) == cache, f"cache {'on' if cache else 'off'}: {r}"
            assert (r["tau"] is None) == (r["mode"] == "plain"), r


def test_bench_workload_frees_each_engine_before_the_next(monkeypatch, capsys):
    """On a GPU the dflash engine plans its KV pools on the memory left free: the plain engine must be gone."""
    import refengine.bench.prefix as prefix

    built: list[weakref.ref] = []
    make = prefix._engine

    def tracked(*args, **kwargs):
        alive = [i for i, ref in enumerate(built) if ref() is not None]
        assert not alive, f"engines {alive} still alive when engine {len(built)} is built"
        engine = make(*args, **kwargs)
        built.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(prefix, "_engine", tracked)
    assert main([*QUICK, "--workload", "shared-prefix", "--enable-prefix-caching"]) == 0, capsys.readouterr().err
    assert len(built) == 2 and built[-1]() is None, "the last engine outlived the bench"


def test_bench_refuses_the_switch_without_a_workload(capsys):
    assert main(["bench", "--device", "cpu", "--enable-prefix-caching"]) == 2
    assert "--workload" in capsys.readouterr().err
