"""The lean FlashInfer plan (refengine/attention/lean_plan.py; bf16, fa2, Qwen3-4B head shapes; marked `gpu`)
against FlashInfer's own plan: two graph-mode wrappers of one bucket on one pool get the same random batches
(decode, verify spans and the drafter's non-causal blocks, real requests then padding requests on the dummy
pages, KV lengths up to ~2,000 tokens), one planned lean after its first plan, one always in full. Every plan
must leave equal plan info, index buffers, KV lengths and work lists, and the attention outputs must be equal
bit for bit, run eagerly and replayed from a CUDA graph captured before the lean plans. Also: a FlashInfer
version the lean plan was not read against keeps the full plan.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_lean_plan.py
"""

from __future__ import annotations

import random

import pytest
import torch

from refengine.attention import graph_attention
from refengine.attention import lean_plan as lean_module
from refengine.attention.base import AttnBatch
from refengine.attention.graph_attention import FlashInferGraphAttention
from refengine.attention.workspace import device_sm_count, flashinfer_float_workspace_bytes
from refengine.kv.pool import KvPool

pytestmark = pytest.mark.gpu
HEADS, KV_HEADS, DIM, PAGE, SPAN = 32, 8, 128, 16, 16
BLOCKS = 4096


def _pool() -> KvPool:
    pool = KvPool(1, BLOCKS, PAGE, KV_HEADS, DIM, torch.bfloat16, torch.device("cuda"), dummy_blocks=1)
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (pool.k[0], pool.v[0]):
        t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32))
    return pool


def _batch(rng: random.Random, bucket: int, causal: bool) -> AttnBatch:
    """Real requests on disjoint random pages, then padding requests (one row, or a drafter's block) on the
    dummy page, as runner/graphs.py lays a graphed step out."""
    real = rng.randint(1, bucket)
    pages = list(range(BLOCKS))
    rng.shuffle(pages)
    q_lens, kv_lens, tables = [], [], []
    for _ in range(real):
        q = SPAN if not causal else rng.choice([1, rng.randint(2, SPAN)])
        kv = rng.randint(q, 2000)
        n = -(-kv // PAGE)
        q_lens.append(q), kv_lens.append(kv), tables.append(pages[:n])
        pages = pages[n:]
    pad = 1 if causal else SPAN
    for _ in range(bucket - real):
        q_lens.append(pad), kv_lens.append(pad), tables.append([BLOCKS])
    return AttnBatch(q_lens, kv_lens, tables, torch.empty(0), torch.empty(0), causal=causal)


def _attention(pool: KvPool, bucket: int) -> FlashInferGraphAttention:
    """A graph wrapper whose workspace holds its bucket's largest plan (bucket x SPAN rows)."""
    ws = flashinfer_float_workspace_bytes(
        HEADS, KV_HEADS, DIM, device_sm_count("cuda"), graph_rows=bucket * SPAN, graph_batch=bucket
    )
    return FlashInferGraphAttention(pool, bucket, HEADS, KV_HEADS, DIM, ws)


def _pair(pool: KvPool, bucket: int, causal: bool):
    """A lean and a full wrapper, each first planned the way graphs.py does: every row of the bucket's largest
    shape on the dummy page."""
    pair = []
    for lean in (True, False):
        att = _attention(pool, bucket)
        att.use_lean_plan = lean
        att._wrapper._int_workspace_buffer.zero_()  # allocated uninitialised: the bytes no plan writes must match
        att._wrapper._pin_memory_int_workspace_buffer.zero_()
        rows = [SPAN] * bucket
        att.plan(AttnBatch(rows, rows, [[BLOCKS]] * bucket, torch.empty(0), torch.empty(0), causal=causal))
        pair.append(att)
    return pair


def _state_mismatches(lean: FlashInferGraphAttention, full: FlashInferGraphAttention, b: int, k: int) -> list[str]:
    lw, fw = lean._wrapper, full._wrapper
    bad = []
    if [int(x) for x in lw._plan_info] != [int(x) for x in fw._plan_info]:
        bad.append(f"plan info {list(lw._plan_info)} != {list(fw._plan_info)}")
    tensors = {
        "qo indptr": (lean._indptr, full._indptr),
        "kv indptr": (lean._kv_indptr, full._kv_indptr),
        "last page lens": (lean._last, full._last),
        "page indices": (lean._indices[:k], full._indices[:k]),
        "kv lens": (lw._kv_lens_buffer[:b], fw._kv_lens_buffer[:b]),
        "work lists": (lw._int_workspace_buffer, fw._int_workspace_buffer),
    }
    for name, (x, y) in tensors.items():
        if not torch.equal(x, y):
            diff = (x != y).nonzero()
            bad.append(f"{name}: {diff.numel()} entries differ, first at {diff[0].tolist()}")
    for field in ("_max_q_len", "_max_kv_len", "_causal", "_batch_size"):
        if getattr(lw, field) != getattr(fw, field):
            bad.append(f"{field}: {getattr(lw, field)} != {getattr(fw, field)}")
    return bad


@pytest.mark.parametrize("bucket,causal", [(1, True), (8, True), (32, True), (8, False), (32, False)])
def test_lean_plans_equal_full_plans(bucket, causal):
    pool, rng = _pool(), random.Random(bucket * 2 + causal)
    lean, full = _pair(pool, bucket, causal)
    assert lean._lean and not full._lean, "the lean plan is not in use on this FlashInfer"
    rows = bucket * SPAN
    q = torch.randn(rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    out_graph = torch.zeros_like(q)
    graph = torch.cuda.CUDAGraph()
    lean.run(0, q, out_graph)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        lean.run(0, q, out_graph)
    failures = []
    for step in range(12):
        batch = _batch(rng, bucket, causal)
        k = sum(-(-kv // PAGE) for kv in batch.kv_lens)
        lean.plan(batch), full.plan(batch)
        torch.cuda.synchronize()
        failures += [f"step {step}: {m}" for m in _state_mismatches(lean, full, bucket, k)]
        n = batch.num_tokens
        out_lean, out_full = torch.zeros_like(q), torch.zeros_like(q)
        lean.run(0, q, out_lean), full.run(0, q, out_full)
        graph.replay()
        torch.cuda.synchronize()
        for name, out in (("eager", out_lean), ("graph", out_graph)):
            if not torch.equal(out[:n], out_full[:n]):
                d = (out[:n].float() - out_full[:n].float()).abs()
                row = int((d.amax(dim=(1, 2)) > 0).nonzero()[0])
                failures.append(
                    f"step {step} {name} output: first differing row {row} of {n}, "
                    f"max delta {d.max().item():.3g}, mean delta {d.mean().item():.3g}"
                )
    assert not failures, "\n".join(failures)


def test_an_unknown_flashinfer_version_keeps_the_full_plan(monkeypatch):
    monkeypatch.setattr(lean_module, "LEAN_PLAN_VERSIONS", ())
    pool = _pool()
    att = _attention(pool, 4)
    rows = [SPAN] * 4
    att.plan(AttnBatch(rows, rows, [[BLOCKS]] * 4, torch.empty(0), torch.empty(0), causal=True))
    assert not att._lean
    calls = []
    monkeypatch.setattr(graph_attention, "lean_plan", lambda *a, **k: calls.append(a))
    att.plan(_batch(random.Random(1), 4, True))
    assert not calls and not att._lean
