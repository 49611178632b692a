"""Tensor-parallel sharding maths in one process (no workers, no process group): for tp 2 and 4 on the tiny
targets (1 and 2 KV heads), the ranks' query heads tile the full set, each rank's KV heads are the ones its
query heads read (GQA), and the sum over ranks of the row-parallel partials (o_proj, down_proj) equals the
unsharded layer within fp32 rounding; head counts that do not split are refused; the server's dense prompt
scoring refuses a shard.

Run: pytest tests/unit/test_tp_sharding.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import FIXTURES
from refengine.errors import UnsupportedConfigError
from refengine.models.qwen3 import Qwen3Model
from refengine.parallel.sharding import check_tensor_parallel, kv_head_range, shard_target


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-gqa2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_shards_recompose_the_layer(name, tp):
    full = Qwen3Model.load(FIXTURES / name / "target")
    cfg, d = full.cfg, full.cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads
    shards = [shard_target(full, r, tp) for r in range(tp)]
    w = full.layers[0]
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.cat([s.layers[0].q_proj for s in shards]), w.q_proj)
    for r, s in enumerate(shards):
        assert s.cfg.num_heads == cfg.num_heads // tp and s.cfg.num_kv_heads == max(cfg.num_kv_heads // tp, 1)
        k0, k1 = kv_head_range(cfg, r, tp)
        for j in range(s.cfg.num_heads):  # local query head j reads local KV head j // local group
            global_q = r * s.cfg.num_heads + j
            local_kv = j // (s.cfg.num_heads // s.cfg.num_kv_heads)
            assert k0 + local_kv == global_q // group
        assert torch.equal(s.layers[0].k_proj, w.k_proj[k0 * d : k1 * d])
    # row-parallel: partial sums over the ranks == the full product
    attn = torch.randn(5, cfg.q_dim, generator=torch.Generator().manual_seed(1))
    nq = cfg.q_dim // tp
    o = sum(F.linear(attn[:, r * nq : (r + 1) * nq], s.layers[0].o_proj) for r, s in enumerate(shards))
    torch.testing.assert_close(o, F.linear(attn, w.o_proj), rtol=1e-5, atol=1e-6)
    mlp = sum(
        F.linear(F.silu(F.linear(x, s.layers[0].gate_proj)) * F.linear(x, s.layers[0].up_proj), s.layers[0].down_proj)
        for s in shards
    )
    want = F.linear(F.silu(F.linear(x, w.gate_proj)) * F.linear(x, w.up_proj), w.down_proj)
    torch.testing.assert_close(mlp, want, rtol=1e-5, atol=1e-6)
    assert all(s.embed_tokens is full.embed_tokens and s.lm_head is full.lm_head for s in shards)  # replicated


def test_head_counts_that_do_not_split_are_refused():
    cfg = Qwen3Model.load(FIXTURES / "tiny-random-gqa2" / "target").cfg  # 4 heads, 2 KV heads
    check_tensor_parallel(cfg, 1)
    with pytest.raises(UnsupportedConfigError, match="num_attention_heads=4 is not divisible by 3"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(UnsupportedConfigError, match="num_attention_heads=4 is not divisible by 8"):
        check_tensor_parallel(cfg, 8)


def test_server_prompt_scoring_refuses_a_shard():
    """refengine.server.scoring runs its own dense forward of the target: on a shard (no all-reduce) it would
    be wrong, so it refuses tp > 1."""
    from refengine.server.scoring import prompt_logprobs

    full = Qwen3Model.load(FIXTURES / "tiny-random" / "target")
    assert prompt_logprobs(full, [5, 6, 7], 2)[1] is not None
    with pytest.raises(UnsupportedConfigError, match="tensor_parallel_size 1 only"):
        prompt_logprobs(shard_target(full, 0, 2), [5, 6, 7], 2)
