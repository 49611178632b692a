"""The HF gate (docs/GOLDEN.md) on the stored goldens: the engine's teacher-forced top-k at every position
of every golden sequence against HF transformers' (prompt through prefill, continuation through decode),
at bs=1 and with all sequences advancing together in one batch (cross-request isolation); two bs=1 runs
are bit-identical; and the gate has teeth: a model with query RoPE positions off by one, or K/V written one slot
late, fails it; so does a target projecting with its embedding instead of lm_head, on an untied pair built on
the fly and gated against live HF records (every stored pair is tied, which hides that swap).

Run: pytest tests/golden/test_hf_gate.py     (CPU, fp32 tolerances from golden/gates.py)
"""

from __future__ import annotations

import pytest

from golden.gates import FP32, hf_gate
from golden.regen import load_golden
from tests.adapter import break_target_head_is_the_embedding, cpu_engine, score_sequences


def _golden(pair):
    if pair.golden is None:
        pytest.skip(f"pair {pair.name} has no stored goldens (python -m golden.regen --pair {pair.name})")
    g = load_golden(pair.name)
    seqs = [(r.name, list(r.prompt_ids), list(r.output_ids)) for r in g.greedy]
    return seqs, g.topk


def test_hf_gate_bs1(model_pair):
    seqs, hf = _golden(model_pair)
    engine = cpu_engine(model_pair.target, max_num_seqs=1)
    report = hf_gate(score_sequences(engine, seqs), hf, FP32)
    print(report)
    assert report.positions == sum(len(p) + len(c) for _, p, c in seqs)
    report.assert_passes()
    engine.check_integrity()


def test_hf_gate_all_sequences_in_one_batch(model_pair):
    seqs, hf = _golden(model_pair)
    assert len(seqs) >= 9
    engine = cpu_engine(model_pair.target, max_num_seqs=len(seqs), max_prefill_tokens=1 << 16)
    records = score_sequences(engine, seqs)
    assert engine.scheduler.running == [] and engine.pool.allocator.num_free == engine.pool.num_blocks
    report = hf_gate(records, hf, FP32)
    print(report)
    report.assert_passes()
    engine.check_integrity()


def test_two_bs1_runs_are_bit_identical(random_pair):
    seqs, _ = _golden(random_pair)
    a = score_sequences(cpu_engine(random_pair.target, max_num_seqs=1), seqs[:6])
    b = score_sequences(cpu_engine(random_pair.target, max_num_seqs=1), seqs[:6])
    for x, y in zip(a, b):
        assert x.topk_ids == y.topk_ids and x.topk_logprobs == y.topk_logprobs, f"{x.name} differs between runs"


def _query_rope_off_by_one(engine):
    # A shift of q and k together is invisible to attention (RoPE is relative), so break the queries only.
    rope, n_heads = engine.target.rope, engine.target.cfg.num_heads
    original = rope.apply
    rope.apply = lambda x, positions: original(x, positions + 1 if x.shape[1] == n_heads else positions)


def _kv_one_slot_late(engine):
    target = engine.target
    original = target.pre_attn
    target.pre_attn = lambda i, h, positions, slots, pool: original(i, h, positions, slots + 1, pool)


@pytest.mark.parametrize("breakage", [_query_rope_off_by_one, _kv_one_slot_late], ids=["q-rope+1", "kv-slot+1"])
def test_gate_fails_a_broken_model(random_pair, breakage):
    seqs, hf = _golden(random_pair)
    engine = cpu_engine(random_pair.target, max_num_seqs=16)
    breakage(engine)
    subset = seqs[:16]  # an explicit subset: the gate checks exactly these names are covered
    report = hf_gate(score_sequences(engine, subset), hf, FP32, names=[n for n, _, _ in subset])
    print(report)
    assert not report.passed, f"the gate let a broken model through:\n{report}"


def test_gate_fails_a_head_swap_on_an_untied_pair(tmp_path):
    from fixtures.build.random_pair import build_random_pair
    from golden.hf_reference import teacher_forced_topk

    target, _ = build_random_pair(tmp_path / "untied", seed=5, tied=False)
    seqs = [(f"s{i}", [(37 * i + 11 * j) % 1000 + 3 for j in range(n)], []) for i, n in enumerate((1, 17, 40))]
    hf = teacher_forced_topk(target, {name: p for name, p, _ in seqs}, k=20)
    hf_gate(score_sequences(cpu_engine(target), seqs), hf, FP32).assert_passes()
    engine = cpu_engine(target)
    break_target_head_is_the_embedding(engine)
    report = hf_gate(score_sequences(engine, seqs), hf, FP32)
    print(report)
    assert not report.passed and len(report.violations) > 10, str(report)
