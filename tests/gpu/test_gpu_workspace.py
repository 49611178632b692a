"""FlashInfer's float workspace at the engine's largest plan (CUDA, bf16, FlashInfer fa2; marked `gpu`): a DFlash
engine with max_num_seqs 256 on a tiny synthetic pair with Qwen3-4B attention heads (32 q / 8 KV heads,
head_dim 128, block 16; hidden 256, 4 + 1 layers) runs 256 requests through prefill and verify steps of 16 rows
each, in every graph mode. In the graph modes the verify and draft wrappers of the 256 bucket are first planned
at 256 x 16 rows, a plan whose split-KV partial outputs (tmp_v) take over 256 MiB (read from the plan FlashInfer
made): it must fit the shared workspace the engine sized (refengine/attention/workspace.py), every request must
finish with all its tokens, and the verify graph must have replayed.

Run on a CUDA machine: python -m pytest -m gpu tests/gpu/test_gpu_workspace.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refengine import SamplingParams
from tests.adapter import gpu_engine

pytestmark = pytest.mark.gpu
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-random"
HEADS, KV_HEADS, HEAD_DIM, B = 32, 8, 128, 16
BATCH, NEW_TOKENS = 256, 20
MIB_256 = 256 << 20  # the 256 x 16 plans must need more: a 256 MiB workspace would overflow


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory) -> tuple[Path, Path]:
    """tiny-random's configs (no weights: loaded synthetic) with Qwen3-4B's attention heads."""
    root = tmp_path_factory.mktemp("wide-heads")
    dirs = []
    for name in ("target", "draft"):
        cfg = json.loads((FIXTURES / name / "config.json").read_text())
        cfg.update(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
        if name == "draft":
            assert cfg["block_size"] == B, cfg["block_size"]
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        dirs.append(root / name)
    return dirs[0], dirs[1]


def _split_kv_bytes(attention) -> tuple[int, int]:
    """(tmp_v + tmp_s bytes of the wrapper's last plan, its float workspace bytes), from FlashInfer's plan info
    (padded_batch_size, ..., cta_tile_q at 3, ..., split_kv at 14)."""
    info = [int(x) for x in attention._wrapper._plan_info]
    assert info[14], f"a CUDA-graph plan always splits the KV: plan info {info}"
    rows = info[0] * info[3]  # padded work items x query rows a tile
    return HEADS * rows * (HEAD_DIM + 1) * 4, attention._wrapper._float_workspace_buffer.numel()


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full"])
def test_dflash_at_256_requests_plans_within_its_workspace(wide_pair, mode):
    target, draft = wide_pair
    engine = gpu_engine(target, draft, graph_mode=mode, max_num_seqs=BATCH, num_blocks=2048, synthetic_weights=True)
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(8)] for i in range(BATCH)]
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True) for _ in prompts]
    reqs = engine.generate(prompts, params)
    engine.check_integrity()
    short = [(i, r.reject_reason, len(r.output_ids)) for i, r in enumerate(reqs) if len(r.output_ids) != NEW_TOKENS]
    assert not short, f"requests without {NEW_TOKENS} tokens (index, reject reason, tokens): {short[:8]}"
    if mode == "eager":
        return
    verify = engine.runner.graphs["verify"]
    assert verify.replays > 0, f"the verify graph never replayed: {verify.replays}"
    draft_graph = engine.runner.draft_graphs.graph
    for kind, runner in (("verify", verify), ("draft", draft_graph)):
        assert BATCH in runner._attention, f"no {kind} wrapper of bucket {BATCH}: {sorted(runner._attention)}"
        need, have = _split_kv_bytes(runner._attention[BATCH])
        assert need > MIB_256, f"{kind}: the {BATCH} x {B} plan takes {need:,} bytes, not past 256 MiB"
        assert need <= have, f"{kind}: the plan takes {need:,} bytes of a {have:,}-byte workspace"
