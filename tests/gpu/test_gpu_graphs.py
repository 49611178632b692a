"""CUDA graphs on the GPU (bf16, FlashInfer fa2; marked `gpu`, skipped without CUDA), every graph mode against
the eager engine, gated by the first-divergence regret gate (bf16 tie flips pass, real bugs do not):

- plain decode and DFlash in `piecewise` and `full` mode, concurrency 1..32 with staggered budgets;
- random spans per request per step (mixed spans replay verify shapes of 2..B rows per request; all-span-1
  steps the decode graph with taps), and GoodputSpans (speculation="adaptive") on the bench's tau1.0
  profile (nothing accepted: it falls back to span 1) and with the real drafter;
- the feature store: what the graphs write there and the drafter reads equals HF's tap outputs (bf16);
- the capture-shape rule: a short-budget request captures the verify graph first, a long one replays it
  (lossless), and with the rule switched off (test-only) the same run diverges;
- the full graph at KV lengths from tens to thousands of tokens, and a deliberately stale attention plan
  (re-planning switched off, test-only) that the same check must catch (in a process of its own).

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_graphs.py -s
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from golden.gates import FEATURE_REL_TOL_BF16, MARGIN_TOL, first_divergence_regret_gate
from refengine import SamplingParams
from refengine.attention.graph_attention import FlashInferGraphAttention
from tests.adapter import break_decode_step_rows_rotated, gpu_engine, greedy, score_sequences
from tests.golden.test_target_features import (
    _two_plain_steps_per_draft,
    assert_adaptive_reports_pass,
    feature_reports,
)
from tests.span_policies import ScriptedSpans

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
    rng = random.Random(concurrency)

    def script(step, req_ids, remaining):
        u = rng.random()
        if u < 0.25:
            return [1] * len(req_ids)
        if u < 0.6:  # a few requests speculate, the rest decode
            return [B if rng.random() < 0.15 else 1 for _ in req_ids]
        return [rng.randint(1, B) for _ in req_ids]

    engine = gpu_engine(
        model_pair.target,
        model_pair.draft,
        graph_mode=mode,
        max_num_seqs=concurrency,
        span_policy=ScriptedSpans(B, script),
    )
    out = greedy(engine, prompts, budgets)
    engine.check_integrity()
    caps = {cap for _, cap in engine.runner.graphs["verify"].graphs}
    assert len(caps) > 1, f"one verify row cap replayed: {caps}"
    score_caps = {cap for _, cap in engine.runner.draft_graphs.graph.graphs}  # type: ignore[union-attr]
    assert len(score_caps) > 1, f"one draft score cap replayed: {score_caps}"
    failures = _regret_failures(eager, prompts, baseline, out, f"{mode}-adaptive-c{concurrency}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("profile", ["tau1.0", None])
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_gpu_goodput_spans_lossless(model_pair, mode, profile):
    """GoodputSpans with its costs seeded from the captured graphs' timed replays: on the bench's tau1.0
    profile (every verify accepts nothing and commits the target's own greedy token) it falls back to span 1
    and replays the decode graph with taps; with the real drafter it chooses as acceptance goes. Same tokens as
    the eager plain engine (gate), integrity after every step."""
    from refengine.spec_decode.acceptance_profile import AcceptanceOverride, parse_profile

    vocab = 1024 if model_pair.name == "tiny-random" else 4096
    prompts = _prompts(16, [1, 5, 16, 17, 60, 200], seed=5, vocab=vocab)
    budgets = [[40, 3, B + 1, 64][i % 4] for i in range(16)]
    eager = gpu_engine(model_pair.target, graph_mode="eager", max_num_seqs=16)
    baseline = greedy(eager, prompts, budgets)
    engine = gpu_engine(model_pair.target, model_pair.draft, graph_mode=mode, max_num_seqs=16, speculation="adaptive")
    if profile is not None:
        engine.scheduler.acceptance_override = AcceptanceOverride(parse_profile(profile))
    engine.capture_graphs()
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, budgets)]
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    stats = engine.span_stats()
    assert stats["errors"] == 0, stats
    if profile is not None:
        spans = {int(k): v for k, v in stats["spans"].items()}
        assert spans.get(1, 0) > sum(v for k, v in spans.items() if k > 1), f"tau1.0 should mostly decode: {stats}"
    out = [r.output_ids for r in reqs]
    failures = _regret_failures(eager, prompts, baseline, out, f"{mode}-goodput-{profile}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_gpu_feature_store_hands_the_drafter_hf_features(trained_pair, mode):
    """The feature store written inside the decode and verify graphs (and by the eager prefill) holds, at the
    rows the drafter reads, HF's tap-layer outputs for the request's own tokens (HF in bf16 on the GPU), within
    FEATURE_REL_TOL_BF16: prefill rows, verify rows and the rows of decode steps at span 1 (two plain steps, then a
    drafting one, so the draft graph both gathers rows in-graph and catches up longer stretches eagerly).
    Teeth: the same run with a decode step's rows rotated between requests fails every request there."""
    kw = dict(make_engine=gpu_engine, hf_dtype=torch.bfloat16, rel_tol=FEATURE_REL_TOL_BF16)
    kw |= dict(graph_mode=mode)
    assert_adaptive_reports_pass(*feature_reports(trained_pair, _two_plain_steps_per_draft, **kw))
    broken, _ = feature_reports(trained_pair, _two_plain_steps_per_draft, break_decode_step_rows_rotated, **kw)
    for rep in broken:
        print(rep)
    bad = [i for i, rep in enumerate(broken) if not rep.passed and rep.first_bad_label.startswith("DecodePlan")]
    assert bad == list(range(len(broken))), f"requests failing at a decode row with rotated rows: {bad}"


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


def _long_context_run(target, draft, stale: bool) -> list[str]:
    FlashInferGraphAttention.skip_replan = stale  # test-only switch (reset by the callers)
    lengths = [20, 300, 1000, 2500, 3900]  # KV from tens to thousands (tiny-trained window: 4096 - 16)
    prompts = _prompts(len(lengths), lengths, seed=5, vocab=4096)
    eager = gpu_engine(target, graph_mode="eager", max_num_seqs=8, max_model_len=4080)
    baseline = greedy(eager, prompts, 64)
    engine = gpu_engine(target, draft, graph_mode="full", max_num_seqs=8, max_model_len=4080)
    out = greedy(engine, prompts, 64)
    return _regret_failures(eager, prompts, baseline, out, "full-long" + ("-stale" if stale else ""))


def test_full_graph_long_kv_lossless(trained_pair, monkeypatch):
    monkeypatch.setattr(FlashInferGraphAttention, "skip_replan", False)
    failures = _long_context_run(trained_pair.target, trained_pair.draft, stale=False)
    assert not failures, "\n".join(failures)


STALE_CHILD = (
    "import sys; from tests.gpu.test_gpu_graphs import _long_context_run; "
    "print('STALE-FAILURES:', _long_context_run(sys.argv[1], sys.argv[2], stale=True))"
)


def test_full_graph_stale_plan_is_caught(trained_pair):
    """In a process of its own: a replay on a stale plan reads the KV pool past what the plan covers, which
    gives wrong tokens (the gate's failures) or, with another memory layout, an illegal memory access, and
    that leaves the CUDA context unusable for every test after it in the same process (H200, run 63)."""
    child = subprocess.run(
        [sys.executable, "-c", STALE_CHILD, str(trained_pair.target), str(trained_pair.draft)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = next((line for line in child.stdout.splitlines() if line.startswith("STALE-FAILURES:")), None)
    print(f"\n[stale plan] exit {child.returncode}: {report or child.stderr[-400:]}")
    if report is not None:
        assert report != "STALE-FAILURES: []", "a graph replayed on its first plan (never re-planned) must fail"
    else:
        assert "illegal memory access" in child.stderr, f"the stale run died otherwise:\n{child.stderr[-2000:]}"
