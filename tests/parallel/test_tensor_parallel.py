"""Tensor parallel 2 on the CPU (issue 15): the target sharded over two processes (gloo, fp32), the DFlash
drafter replicated on rank 0. Checks: config validation (head counts, graph modes); outputs at tp2 equal tp1
(greedy tokens identical; teacher-forced top-k of tp2 gated against tp1's with the fp32 HF-gate tolerances,
since the all-reduce sums the row-parallel partials in a different order than one matmul); the HF gate at tp2
on an explicit subset of the goldens; the lossless suite at tp2 (spec on with the real tiny drafter == plain
greedy, staggered budgets); acceptance at tp2 equals tp1 (per-request committed_per_step) and passes the
acceptance goldens; a worker that is killed, or hangs, fails the engine with TensorParallelError within the
group timeout, never a hang; Engine.close / the context manager stop the workers.

Run: pytest -m tp tests/parallel      (deselect locally with -m 'not tp'; each tp2 engine starts in ~3 s)
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from golden.acceptance import acceptance_gate
from golden.gates import FP32, hf_gate
from golden.regen import load_golden
from refengine import Engine, EngineConfig, SamplingParams
from refengine.errors import TensorParallelError, UnsupportedConfigError
from tests.adapter import acceptance_record, assert_same_tokens, cpu_engine, greedy, run_requests, score_sequences

pytestmark = pytest.mark.tp


def _scored_subset(pair, n: int):
    g = load_golden(pair.name)
    seqs = [(r.name, list(r.prompt_ids), list(r.output_ids)) for r in g.greedy][:n]
    return seqs, g.topk


def test_config_validation(random_pair):
    with pytest.raises(UnsupportedConfigError, match="graph modes are tensor-parallel size 1 only"):
        EngineConfig(str(random_pair.target), tensor_parallel_size=2, graph_mode="piecewise")
    with pytest.raises(UnsupportedConfigError, match="tensor_parallel_size"):
        EngineConfig(str(random_pair.target), tensor_parallel_size=0)
    with pytest.raises(UnsupportedConfigError, match="tensor_parallel_timeout_s"):
        EngineConfig(str(random_pair.target), tensor_parallel_size=2, tensor_parallel_timeout_s=0)
    assert EngineConfig(str(random_pair.target), device="cuda", tensor_parallel_size=2).graph_mode_name == "eager"
    # 4 query heads do not split over 3 ranks: refused at load, before any worker starts
    with pytest.raises(UnsupportedConfigError, match="num_attention_heads=4 is not divisible by 3"):
        cpu_engine(random_pair.target, tensor_parallel_size=3)


def test_tp2_equals_tp1_and_passes_the_hf_gate(random_pair):
    """One tp2 engine: teacher-forced scores of 12 goldens (one batch) pass the HF gate and match tp1's within
    the fp32 gate; greedy outputs are identical to tp1's."""
    seqs, hf = _scored_subset(random_pair, 12)
    names = [n for n, _, _ in seqs]
    prompts = [p for _, p, _ in seqs[:4]]
    tp1_engine = cpu_engine(random_pair.target, max_num_seqs=16)
    tp1 = score_sequences(tp1_engine, seqs)
    tp1_out = greedy(tp1_engine, prompts, [1, 9, 17, 30])
    with cpu_engine(random_pair.target, max_num_seqs=16, tensor_parallel_size=2) as engine:
        tp2 = score_sequences(engine, seqs)
        tp2_out = greedy(engine, prompts, [1, 9, 17, 30])
        assert engine.pool.allocator.num_free == engine.pool.num_blocks
    report = hf_gate(tp2, hf, FP32, names=names)
    print("tp2 vs HF:", report)
    report.assert_passes()
    vs_tp1 = hf_gate(tp2, tp1, FP32, names=names)
    print("tp2 vs tp1:", vs_tp1)
    vs_tp1.assert_passes()
    assert all(a.topk_ids[p][0] == b.topk_ids[p][0] for a, b in zip(tp2, tp1) for p in range(len(a.token_ids)))
    for i, (a, b) in enumerate(zip(tp2_out, tp1_out)):
        assert_same_tokens(a, b, f"tp2 vs tp1 greedy, prompt {i}")


def test_lossless_dflash_tp2_staggered(random_pair):
    """Spec on at tp2 (real tiny drafter, replicated on rank 0) == plain greedy at tp1, budgets around the
    block size, half the requests arriving while the first half is mid-generation."""
    seqs, _ = _scored_subset(random_pair, 6)
    prompts = [p for _, p, _ in seqs]
    budgets = [1, 2, 15, 16, 17, 40]
    plain = greedy(cpu_engine(random_pair.target), prompts, budgets)
    with cpu_engine(random_pair.target, random_pair.draft, tensor_parallel_size=2) as engine:
        items = [(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, budgets)]
        reqs = run_requests(engine, items, stagger_after=3)
        assert engine.spec_stats(reqs).verify_steps > 0
        engine.check_integrity()
        assert engine.pool.allocator.num_free == engine.pool.num_blocks
    for i, (r, p) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, p, f"tp2 spec vs tp1 plain, prompt {i} (budget {budgets[i]})")


def test_acceptance_tp2_equals_tp1(trained_pair):
    """The trained pair (real acceptance): per-request committed_per_step at tp2 equals tp1, and tp2 passes
    the acceptance goldens (the 7 text prompts, one concurrent batch)."""
    goldens = [g for g in load_golden(trained_pair.name).acceptance if not g.name.startswith("random-")]
    items = [(g.prompt_ids, SamplingParams(max_tokens=len(g.output_ids))) for g in goldens]
    tp1 = [acceptance_record(g.name, r) for g, r in zip(goldens, run_requests(cpu_engine(*_pair(trained_pair)), items))]
    with cpu_engine(*_pair(trained_pair), tensor_parallel_size=2) as engine:
        tp2 = [acceptance_record(g.name, r) for g, r in zip(goldens, run_requests(engine, items))]
    for a, b in zip(tp2, tp1):
        assert a.output_ids == b.output_ids, f"{a.name}: tp2 output differs from tp1"
        # the request's spec.committed_per_step, as acceptance_record stores it
        assert a.accepted_lengths == b.accepted_lengths, f"{a.name}: tp2 {a.accepted_lengths} tp1 {b.accepted_lengths}"
    assert sum(len(a.accepted_lengths) for a in tp2) < sum(len(a.output_ids) for a in tp2), "nothing accepted"
    report = acceptance_gate(tp2, goldens, names=[g.name for g in goldens])
    print(report)
    report.assert_passes()


def _pair(pair):
    return pair.target, pair.draft


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["worker-killed", "worker-hangs"])
def test_failed_rank_fails_the_engine(random_pair, sig):
    """A worker killed mid-run (its connection resets) or stopped mid-run (the all-reduce times out) fails the
    step with TensorParallelError within the group timeout; every later step raises it too; close() reaps."""
    timeout = 4.0
    engine = cpu_engine(random_pair.target, max_num_seqs=4, tensor_parallel_size=2, tensor_parallel_timeout_s=timeout)
    try:
        for p in ([5, 6, 7], [8, 9]):
            engine.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True))
        engine.step()
        engine.step()
        assert engine.tp is not None
        worker = engine.tp.procs[0]
        os.kill(worker.pid, sig)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor parallel") as info:
            while engine.has_work():
                engine.step()
        elapsed = time.monotonic() - t0
        print(f"{sig!r}: failed after {elapsed:.2f} s: {info.value}")
        assert elapsed < timeout + 5
        assert "close it" in str(info.value)
        with pytest.raises(TensorParallelError):
            engine.step()
    finally:
        if sig == signal.SIGSTOP and engine.tp is not None:
            os.kill(engine.tp.procs[0].pid, signal.SIGKILL)
        engine.close()
    assert engine.tp is not None and not engine.tp.procs[0].is_alive()


def test_close_stops_workers_and_frees_the_group(random_pair):
    with cpu_engine(random_pair.target, tensor_parallel_size=2) as engine:
        assert engine.tp is not None
        procs = list(engine.tp.procs)
        assert all(p.is_alive() for p in procs)
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(TensorParallelError, match="closed"):
        engine.tp.check()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(TensorParallelError, match="closed"):
        engine.step()  # the prefill's forward reaches the closed group
    # the process group was released: a second tp engine can start in this process
    with Engine(EngineConfig(str(random_pair.target), tensor_parallel_size=2)) as again:
        assert again.tp is not None and again.tp.procs[0].is_alive()
