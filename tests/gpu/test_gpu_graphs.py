"""CUDA graphs on the GPU (bf16, FlashInfer fa2; marked `gpu`, skipped without CUDA), every graph mode against
the eager engine, gated by the first-divergence regret gate (bf16 tie flips pass, real bugs do not):

- plain decode and DFlash in `piecewise` and `full` mode, concurrency 1..32 with staggered budgets;
- adaptive speculation with random spans per request per step (mixed spans replay verify shapes of 2..B
  rows per request; all-span-1 steps the decode graph with taps), and the drafts it proposes are the same
  whether those decode rows' features waited on the host (the default) or on the device;
- the capture-shape rule: a short-budget request captures the verify graph first, a long one replays it
  (lossless), and with the rule switched off (test-only) the same run diverges;
- the full graph at KV lengths from tens to thousands of tokens, and a deliberately stale attention plan
  (re-planning switched off, test-only) that the same check must catch.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_graphs.py -s
"""

from __future__ import annotations

import random

import pytest

from golden.gates import MARGIN_TOL, first_divergence_regret_gate
from refengine.attention.graph_attention import FlashInferGraphAttention
from tests.adapter import first_divergence, gpu_engine, greedy, record_drafts, score_sequences

pytestmark = pytest.mark.gpu
B = 16


def _prompts(n: int, lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 1) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def _regret_failures(scorer, prompts, baseline, outputs, label) -> list[str]:
    def score(ids):
        return score_sequences(scorer, [("rescore", ids[:-1], ids[-1:])])[0]

    bad = []
    for i, (p, b, o) in enumerate(zip(prompts, baseline, outputs)):
        rep = first_divergence_regret_gate(p, b, o, score, tol=MARGIN_TOL, reanchor=True, name=f"{label}-{i}")
        if rep.violations:
            bad.append(
                f"{label}-{i}: first divergence {rep.first_divergence}, regret {rep.first_regret:.3f}, "
                f"{len(rep.violations)} violations"
            )
    return bad


@pytest.mark.parametrize("mode", ["piecewise", "full"])
@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_gpu_graph_modes_lossless(model_pair, mode, concurrency):
    vocab = 1024 if model_pair.name == "tiny-random" else 4096
    prompts = _prompts(concurrency, [1, 5, 16, 17, 60, 200], seed=concurrency, vocab=vocab)
    budgets = [[40, 1, 2, B - 1, B, B + 1, 64][i % 7] for i in range(concurrency)]
    eager = gpu_engine(model_pair.target, graph_mode="eager", max_num_seqs=concurrency)
    baseline = greedy(eager, prompts, budgets)
    failures = []
    for draft in (None, model_pair.draft):
        engine = gpu_engine(model_pair.target, draft, graph_mode=mode, max_num_seqs=concurrency)
        out = greedy(engine, prompts, budgets)
        engine.check_integrity()
        replays = {k: v.replays for k, v in engine.runner.graphs.items()}
        assert sum(replays.values()) > 0, f"no graph replayed: {replays}"
        failures += _regret_failures(eager, prompts, baseline, out, f"{mode}-{'dflash' if draft else 'plain'}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
@pytest.mark.parametrize("concurrency", [8, 32])
def test_gpu_adaptive_random_spans_lossless(model_pair, mode, concurrency):
    vocab = 1024 if model_pair.name == "tiny-random" else 4096
    prompts = _prompts(concurrency, [1, 5, 16, 17, 60, 200], seed=concurrency + 1, vocab=vocab)
    budgets = [[40, 1, 2, B - 1, B, B + 1, 64][i % 7] for i in range(concurrency)]
    eager = gpu_engine(model_pair.target, graph_mode="eager", max_num_seqs=concurrency)
    baseline = greedy(eager, prompts, budgets)
    engine = gpu_engine(
        model_pair.target, model_pair.draft, graph_mode=mode, max_num_seqs=concurrency, speculation="adaptive"
    )
    rng = random.Random(concurrency)

    def choose(req_ids, remaining):
        u = rng.random()
        if u < 0.25:
            return [1] * len(req_ids)
        if u < 0.6:  # a few requests speculate, the rest decode
            return [B if rng.random() < 0.15 else 1 for _ in req_ids]
        return [rng.randint(1, B) for _ in req_ids]

    engine.scheduler.policy.choose = choose  # type: ignore[union-attr]
    out = greedy(engine, prompts, budgets)
    engine.check_integrity()
    caps = {cap for _, cap in engine.runner.graphs["verify"].graphs}
    assert len(caps) > 1, f"one verify row cap replayed: {caps}"
    failures = _regret_failures(eager, prompts, baseline, out, f"{mode}-adaptive-c{concurrency}")
    assert not failures, "\n".join(failures)


def test_gpu_decode_features_on_the_host_give_the_same_drafts(trained_pair, monkeypatch):
    """All-span-1 steps stage their tap features on the host (ModelRunner._replay), moved to the device past a
    bound (set to a few rows here, so it is crossed): the drafter context built from them must give exactly the
    drafts the device-staged path gives, step for step."""
    import refengine.runner.model_runner as model_runner
    import refengine.spec_decode.lane as lane_module

    prompts = _prompts(8, [5, 16, 40], seed=3, vocab=4096)
    budgets = [48] * 8

    def run(to_host: bool) -> tuple[list[list[list[int]]], int]:
        monkeypatch.setattr(model_runner, "DECODE_FEATURES_TO_HOST", to_host)
        engine = gpu_engine(
            trained_pair.target, trained_pair.draft, graph_mode="full", max_num_seqs=8, speculation="adaptive"
        )
        monkeypatch.setattr(lane_module, "HOST_PENDING_BYTES", 20 * engine.proposer._width * 2)  # 20 bf16 rows
        rng = random.Random(5)
        engine.scheduler.policy.choose = lambda ids, rem: (  # type: ignore[union-attr]
            [1] * len(ids) if rng.random() < 0.7 else [B] * len(ids)
        )
        log = record_drafts(engine)
        greedy(engine, prompts, budgets)
        engine.check_integrity()
        return log, engine.proposer.host_moves

    (host, moves), (device, no_moves) = run(True), run(False)
    assert len(host) > 3, f"only {len(host)} draft steps ran"
    assert moves > 0 and no_moves == 0, f"host rows moved {moves} times (host path), {no_moves} (device path)"
    first = first_divergence(host, device)
    assert first is None, (
        f"drafts differ at draft step {first} of {len(host)} (host) / {len(device)} (device): "
        f"{host[first] if first is not None else ''} vs {device[first] if first is not None else ''}"
    )


def _short_then_long(pair, mode: str, rule: bool):
    prompts, budgets = [[5, 7, 9], [11, 12, 13, 14]], [4, 48]
    eager = gpu_engine(pair.target, graph_mode="eager", max_num_seqs=4)
    want = [greedy(eager, [p], m)[0] for p, m in zip(prompts, budgets)]
    engine = gpu_engine(pair.target, pair.draft, graph_mode=mode, max_num_seqs=4)
    engine.runner.graphs["verify"].capture_shape_rule = rule  # test-only switch
    got = [greedy(engine, [p], m)[0] for p, m in zip(prompts, budgets)]
    return eager, prompts, want, got


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_short_then_long_verify_capture_is_lossless(trained_pair, mode):
    eager, prompts, want, got = _short_then_long(trained_pair, mode, rule=True)
    failures = _regret_failures(eager, prompts, want, got, f"{mode}-rule-on")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_short_then_long_capture_fails_without_the_rule(trained_pair, mode):
    eager, prompts, want, got = _short_then_long(trained_pair, mode, rule=False)
    failures = _regret_failures(eager, prompts, want, got, f"{mode}-rule-off")
    print(f"\n[rule off, {mode}] " + "; ".join(failures))
    assert failures, "the capture-shape rule switched off must make the long request diverge beyond a tie"


def _long_context_run(pair, stale: bool, monkeypatch):
    monkeypatch.setattr(FlashInferGraphAttention, "skip_replan", stale)
    lengths = [20, 300, 1000, 2500, 3900]  # KV from tens to thousands (tiny-trained window: 4096 - 16)
    prompts = _prompts(len(lengths), lengths, seed=5, vocab=4096)
    eager = gpu_engine(pair.target, graph_mode="eager", max_num_seqs=8, max_model_len=4080)
    baseline = greedy(eager, prompts, 64)
    engine = gpu_engine(pair.target, pair.draft, graph_mode="full", max_num_seqs=8, max_model_len=4080)
    out = greedy(engine, prompts, 64)
    return _regret_failures(eager, prompts, baseline, out, "full-long" + ("-stale" if stale else ""))


def test_full_graph_long_kv_lossless(trained_pair, monkeypatch):
    failures = _long_context_run(trained_pair, stale=False, monkeypatch=monkeypatch)
    assert not failures, "\n".join(failures)


def test_full_graph_stale_plan_is_caught(trained_pair, monkeypatch):
    failures = _long_context_run(trained_pair, stale=True, monkeypatch=monkeypatch)
    print("\n[stale plan] " + "; ".join(failures))
    assert failures, "a graph replayed on its first plan (never re-planned) must fail the gate at long KV"
