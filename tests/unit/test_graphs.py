"""The graph runner's logic on the CPU, with the fake capturer (replay = call the captured pieces again) and
the torch kernels: batch buckets, packing a step into a bucket (real rows first, padding on the dummy pages),
every graph mode lossless against eager greedy with heterogeneous budgets and staggered arrivals, and the
capture-shape rule: a verify graph first captured by a short (budget-truncated) step must still serve a long
one; with the rule switched off (test-only) the same run diverges, as upstream's engine did; the draft graph's
score caps (a draft whose spans are short scores fewer rows a block, the same drafts) and their cost keys.

Run: pytest tests/unit/test_graphs.py        (the same checks on CUDA: tests/gpu/test_gpu_graphs.py)
"""

from __future__ import annotations

import gc
import weakref

import pytest

from refengine import SamplingParams
from refengine.runner.graphs import StepRow
from refengine.runner.shapes import batch_buckets, row_caps
from refengine.spec_decode.proposer import DraftItem
from tests.adapter import assert_same_tokens, cpu_engine, greedy
from tests.span_policies import random_spans

B = 16


def test_batch_buckets_cover_every_batch_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    for n in range(1, 65):
        assert min(b for b in batch_buckets(64) if b >= n) - n < 8


def test_verify_shapes_fit_the_rows_of_the_step(random_pair):
    """A step replays the smallest (bucket, cap) shape that holds its rows: one full span among 31 one-row
    requests costs 2 rows per request, not B; capture_all captures every shape once."""
    assert row_caps(16) == (2, 4, 8, 16) and row_caps(8) == (2, 4, 8) and row_caps(2) == (2,)
    engine = cpu_engine(random_pair.target, random_pair.draft, graph_mode="full", max_num_seqs=32)
    verify, decode = engine.runner.graphs["verify"], engine.runner.graphs["decode"]
    assert verify.shape_for(32, 31 + B) == (32, 2) and verify.executed_rows(32, 31 + B) == 64
    assert verify.shape_for(32, 32 * B) == (32, B)
    assert verify.shape_for(30, 60) == (32, 2), "two padding requests add a row each: 62 rows fit 32 x 2"
    assert verify.shape_for(30, 63) == (32, 4)
    assert verify.shape_for(1, 3) == (1, 4) and verify.shape_for(1, B) == (1, B)
    assert decode.shape_for(5, 5) == (8, 1)
    small = cpu_engine(random_pair.target, random_pair.draft, graph_mode="piecewise", max_num_seqs=4)
    runner = small.runner.graphs["verify"]
    assert runner.capture_all() == len(batch_buckets(4)) * len(row_caps(B)) and runner.capture_all() == 0
    shared = {id(g.attention) for (bucket, _), g in runner.graphs.items() if bucket == 4}
    assert len(shared) == 1, "the shapes of one bucket share one attention wrapper"


def test_a_draft_scores_only_the_rows_its_spans_read(trained_pair):
    """The draft graph's score caps (graph_setup.draft_score_caps): a draft whose largest span is S replays the
    shape that scores rows 1..cap-1 of each block, cap the least of 4, 8, 16 >= S; its drafts are the full
    shape's first ones; a bucket's caps share its buffers but for the scored rows; the runner's step shapes
    (the span policy's cost keys) name each cap and every captured shape is timed; the bucket's drafts write
    their context rows into one host buffer, kept."""
    engine = cpu_engine(
        trained_pair.target, trained_pair.draft, graph_mode="full", max_num_seqs=4, speculation="adaptive"
    )
    lane, runner = engine.proposer, engine.runner
    draft = runner.draft_graphs.graph
    assert [draft.shape_for(3, 0, s) for s in (2, 4, 5, 8, 9, B)] == [(4, 4), (4, 4), (4, 8), (4, 8), (4, B), (4, B)]
    shapes = runner.step_shapes()
    assert [shapes.draft_cap(s) for s in (3, 8, B)] == [4, 8, B] and shapes.draft_bucket(3) == 4
    assert engine.capture_graphs() > 0
    assert set(draft.graphs) == {(b, c) for b in batch_buckets(4) for c in (4, 8, B)}
    full, short = draft.graphs[(4, B)], draft.graphs[(4, 4)]
    assert full.buffers.hidden.data_ptr() == short.buffers.hidden.data_ptr(), "a bucket's caps share buffers"
    assert (short.buffers.argmax.numel(), full.buffers.argmax.numel()) == (4 * 3, 4 * (B - 1))
    timed = {(c.kind, c.bucket, c.cap) for c in runner.shape_costs()}
    assert {("draft", 4, 4), ("draft", 4, 8), ("draft", 4, B)} <= timed, sorted(timed)
    table = engine.span_policy.costs.table  # type: ignore[union-attr]  (GoodputSpans, seeded by the timings)
    assert table[("draft", 4, 4)] > 0 and ("verify", 4, 2) in table and ("decode", 4, 1) in table, sorted(table)
    reqs = [engine.add_request([5, 7, 9 + i], SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(3)]
    engine.step()  # the prefill

    def items(span):
        return [DraftItem(r.request_id, r.output_ids[-1], r.committed_len, span) for r in reqs]

    wide = lane.launch(items(B))
    assert wide is not None and wide.width == B - 1
    got_wide = wide.read()
    host = runner.draft_graphs._context_host[4 * B]  # the bucket's context rows on the host (DraftGraphs)
    narrow = lane.launch(items(4))
    assert narrow is not None and narrow.width == 3
    got = narrow.read()
    assert got == [d[:3] for d in got_wide], f"score cap 4 drafts {got} against the full shape's {got_wide}"
    held = runner.draft_graphs._context_host
    assert list(held) == [4 * B] and held[4 * B] is host, f"context rows staged anew: {sorted(held)}"


def test_a_plans_page_entries_fit_the_graph_wrappers_buffers(trained_pair, monkeypatch):
    """Full-length requests filling the pool exactly, padded to their bucket: a verify plan lists every real
    page plus each padding request's dummy page, more entries than the pool has pages. FlashInfer's graph
    wrappers size their page-index buffers by page_entries_capacity (the GPU memory test overflowed by one
    entry at 45 requests of 768 pages in a bucket of 48); every plan here fits it."""
    import math

    from refengine.attention import graph_attention
    from refengine.kv.pool import blocks_for

    life, new, fit = 256, 24, 5
    engine = cpu_engine(
        trained_pair.target,
        trained_pair.draft,
        graph_mode="full",
        max_num_seqs=8,
        max_model_len=life,
        num_blocks=fit * blocks_for(life, 16) + 1,
    )
    worst: dict[int, tuple[int, int, int]] = {}  # wrapper -> (most entries, its pool's pages, its capacity)
    plan = graph_attention.TorchGraphAttention.plan

    def counted(self, batch):
        entries = sum(math.ceil(k / self.pool.page_size) for k in batch.kv_lens)
        cap = graph_attention.page_entries_capacity(self.pool, len(batch.kv_lens))
        worst[id(self)] = (max(worst.get(id(self), (0,))[0], entries), self.pool.k[0].shape[0], cap)
        return plan(self, batch)

    monkeypatch.setattr(graph_attention.TorchGraphAttention, "plan", counted)
    reqs = [engine.add_request([7] * (life - new), SamplingParams(max_tokens=new, ignore_eos=True)) for _ in range(6)]
    while engine.has_work():
        engine.step()
    assert all(len(r.output_ids) == new for r in reqs)
    assert any(e > pages for e, pages, _ in worst.values()), f"no plan listed more entries than pages: {worst}"
    over = [(e, cap) for e, _, cap in worst.values() if e > cap]
    assert not over, f"plans listing more page entries than the wrapper holds (entries, capacity): {over}"


def test_layout_packs_real_rows_then_padding_on_dummy_pages(random_pair):
    engine = cpu_engine(random_pair.target, random_pair.draft, graph_mode="piecewise", max_num_seqs=4)
    reqs = [engine.add_request([3] * n, SamplingParams(max_tokens=20, ignore_eos=True)) for n in (5, 17)]
    engine.step()  # prefill both
    verify = engine.runner.graphs["verify"]
    g = verify._graph(4, B, 4 * B)
    steps = [StepRow(r.request_id, r.committed_len, [1] * s, r.committed_len + s) for r, s in zip(reqs, (B, 3))]
    for r, s in zip(reqs, (B, 3)):
        engine.pool.extend(r.request_id, s)  # reserve the span's slots, as schedule_speculative does
    batch, inputs = g.layout(steps, engine.pool)
    pool, page = engine.pool, engine.pool.page_size
    dummy = {d * page + o for d in pool.dummy_blocks for o in range(page)}
    assert batch.q_lens == [B, 3, 1, 1] and batch.kv_lens == [5 + B, 17 + 3, 1, 1]
    assert batch.block_tables[2:] == [pool.dummy_blocks] * 2
    real = B + 3
    assert (
        inputs[2, :real].tolist()
        == pool.slots(reqs[0].request_id, 5, 5 + B).tolist() + pool.slots(reqs[1].request_id, 17, 20).tolist()
    )
    assert set(inputs[2, real:].tolist()) <= dummy, "padding rows must write only to the dummy pages"
    assert inputs.shape[1] == 4 * B


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graph_modes_lossless_staggered_budgets(model_pair, mode):
    prompts = [[(7 * i + j) % 50 + 1 for j in range(n)] for i, n in enumerate([1, 5, 16, 17, 33, 40])]
    budgets = [1, B - 1, B, B + 1, 2, 40]
    want = greedy(cpu_engine(model_pair.target), prompts, budgets)
    for draft in (None, model_pair.draft):
        engine = cpu_engine(model_pair.target, draft, graph_mode=mode, max_num_seqs=8)
        reqs = [
            engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts[:3], budgets[:3])
        ]
        engine.step()
        reqs += [
            engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))  # arrive mid-run
            for p, m in zip(prompts[3:], budgets[3:])
        ]
        while engine.has_work():
            engine.step()
            engine.check_integrity()
        for i, (r, w) in enumerate(zip(reqs, want)):
            assert_same_tokens(r.output_ids, w, f"{mode} {'dflash' if draft else 'plain'} request {i}")
        replays = {k: v.replays for k, v in engine.runner.graphs.items()}
        assert replays["decode" if draft is None else "verify"] > 0, f"no graph replayed: {replays}"
        if draft is not None:
            assert engine.runner.draft_graphs.graph.replays > 0


def _short_then_long(pair, mode: str, rule: bool) -> tuple[list[list[int]], list[list[int]]]:
    prompts, budgets = [[5, 7, 9], [11, 12, 13, 14]], [4, 40]
    want = [greedy(cpu_engine(pair.target), [p], m)[0] for p, m in zip(prompts, budgets)]
    engine = cpu_engine(pair.target, pair.draft, graph_mode=mode, max_num_seqs=4)
    engine.runner.graphs["verify"].capture_shape_rule = rule  # test-only switch
    got = [greedy(engine, [p], m)[0] for p, m in zip(prompts, budgets)]  # the short one captures bucket 1 first
    return got, want


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_short_then_long_verify_capture_is_lossless(model_pair, mode):
    got, want = _short_then_long(model_pair, mode, rule=True)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_tokens(g, w, f"{mode}: request {i} (short first, then long, one engine)")


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_short_then_long_capture_breaks_without_the_rule(trained_pair, mode):
    got, want = _short_then_long(trained_pair, mode, rule=False)
    assert got[0] == want[0], "the short request itself is computed in full"
    assert got[1] != want[1], "with the capture-shape rule off, the long request must replay a short graph and diverge"


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_dropped_engine_frees_its_pools_without_a_gc_pass(trained_pair, mode):
    """Captured pieces must not close over their own graph: a reference cycle kept a dropped engine's KV
    pools alive until a gc pass, and the next engine on the device planned around memory still held."""
    engine = cpu_engine(trained_pair.target, trained_pair.draft, graph_mode=mode, max_num_seqs=4)
    greedy(engine, [[5, 7, 9]], 20)
    target_kv, draft_kv = weakref.ref(engine.pool.k[0]), weakref.ref(engine.proposer.pool.k[0])
    gc.disable()
    try:
        del engine
        assert target_kv() is None and draft_kv() is None, "the engine's pools outlived it (a reference cycle)"
    finally:
        gc.enable()


def test_steps_that_capture_a_graph_are_not_cost_samples(trained_pair):
    """The span policy's cost samples are the steps' measured times; a step that captured a graph took far longer
    than its shape costs, so its report carries no time. After capture_graphs() (bench, serve) every step is a
    sample."""
    for warm in (False, True):
        policy = random_spans(B, seed=1)
        engine = cpu_engine(
            trained_pair.target, trained_pair.draft, graph_mode="piecewise", max_num_seqs=4, span_policy=policy
        )
        if warm:
            assert engine.capture_graphs() > 0
        before = engine.runner.graph_captures()
        greedy(engine, [[5, 7, 9]], 30)
        timed = sum(rep.seconds is not None for rep in policy.reports)
        untimed = len(policy.reports) - timed
        captured = engine.runner.graph_captures() - before
        ok = untimed == 0 if warm else 0 < untimed <= captured
        assert ok, f"warm={warm}: {untimed} of {len(policy.reports)} steps untimed, {captured} graphs captured"
        verify = [rep for rep in policy.reports if rep.seconds is not None and max(rep.spans) > 1]
        assert verify and all(0 <= rep.draft_seconds <= rep.seconds for rep in verify)  # type: ignore[operator]


def test_a_steps_cost_sample_is_its_whole_wall_time(trained_pair):
    """The span policy prices a step by its whole wall time, the host's scheduling, checks and commit around
    the runner's forward included (Engine.step -> Scheduler.report_step): every timed report is longer than the
    runner's own time for that step, and a verify's draft share stays within it."""
    policy = random_spans(B, seed=2)
    engine = cpu_engine(trained_pair.target, trained_pair.draft, span_policy=policy)
    runner_s: list[float | None] = []
    execute = engine.runner.execute

    def timed(plan):
        result = execute(plan)
        if plan.requests and type(plan).__name__ != "PrefillPlan":
            runner_s.append(result.seconds)
        return result

    engine.runner.execute = timed  # type: ignore[method-assign]
    greedy(engine, [[5, 7, 9], [11, 12]], 24)
    assert len(policy.reports) == len(runner_s) > 0
    for rep, ran in zip(policy.reports, runner_s):
        assert rep.seconds is not None and ran is not None and rep.seconds > ran, (rep.seconds, ran)
        assert rep.draft_seconds is None or rep.draft_seconds <= ran


def test_timing_the_shapes_touches_no_request(trained_pair):
    """capture_graphs times every shape's replay (the span policy's start-up cost table) on the dummy
    pages: called mid-run, with live requests' KV and drafter context in the pools, the outputs stay exact."""
    prompts, budgets = [[5, 7, 9], [11, 12, 13, 14, 15]], [40, 33]
    want = greedy(cpu_engine(trained_pair.target), prompts, budgets)
    engine = cpu_engine(
        trained_pair.target, trained_pair.draft, graph_mode="full", max_num_seqs=4, speculation="adaptive"
    )
    reqs = [engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, budgets)]
    for _ in range(4):
        engine.step()
    assert engine.capture_graphs() > 0
    timed = engine.runner.shape_costs()
    kinds = {c.kind for c in timed}
    verify = [c for c in timed if c.kind == "verify"]
    assert kinds == {"decode", "verify", "draft"} and len(verify) == len(engine.runner.graphs["verify"].graphs)
    assert all(c.seconds > 0 for c in timed)
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    for i, (r, w) in enumerate(zip(reqs, want)):
        assert_same_tokens(r.output_ids, w, f"request {i} (shapes timed mid-run)")


def test_eager_segmented_forward_equals_the_layer_forward(random_pair):
    """With graphs on, prefills (and steps no graph fits) run the segmented stack eagerly: the final normed
    hidden rows and the tap features must equal models/qwen3.py's layer-by-layer forward (fp32, two ragged
    requests)."""
    import torch

    engine = cpu_engine(random_pair.target, random_pair.draft, graph_mode="full", max_num_seqs=4)
    runner, pool = engine.runner, engine.pool
    assert runner.stack is not None
    lens = (7, 12)
    for rid, n in enumerate(lens):
        pool.admit(rid, n)
        pool.extend(rid, n)
    batch = runner._batch([(rid, 0, n) for rid, n in enumerate(lens)])
    ids = torch.randint(0, engine.target.cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    layers = engine.proposer.capture_layers
    with torch.inference_mode():
        want_h, want_f = engine.target.forward(ids, batch, pool, runner.attention, layers)
        got_h, got_f = runner._forward_segmented(ids, batch, taps=True)
        no_h, no_f = runner._forward_segmented(ids, batch, taps=False)
    for name, got, want in (("hidden", got_h, want_h), ("taps", got_f, want_f), ("hidden, no taps", no_h, want_h)):
        delta = (got - want).abs()
        shape = list(got.shape)
        assert delta.max() < 1e-4, f"{name}: max delta {delta.max():.3g}, mean {delta.mean():.3g} over {shape}"
    assert no_f is None
