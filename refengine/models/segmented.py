"""A decoder stack cut into dense segments around attention, over persistent buffers: what the CUDA graphs
capture. The Qwen3 target and the DFlash drafter share it (same layer structure; the drafter has no taps,
attends non-causally and scores rows 1..B-1 of each block).

    segment 0        embed, input norm of layer 0, pre_attn(0)
    attention i      (eager in piecewise mode, inside the graph in full mode)
    segment i        post_attn(i-1), residual add + input norm of layer i (the tap of layer i-1), pre_attn(i)
    segment L        post_attn(L-1), residual add + final norm (the tap of layer L-1), lm_head, argmax

pre_attn = merged QKV GEMM, then per-head q/k norm, RoPE and K/V written at the rows' slots (one fused kernel on
CUDA: models/pre_attn_kernel.py); post_attn = o_proj,
residual add + post-attention norm, merged gate/up GEMM, SiLU-and-mul, down_proj. A residual stream is kept
apart from the hidden rows so each residual add fuses into the next norm (FlashInfer fused_add_rmsnorm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from refengine.config import ModelConfig
from refengine.kv.pool import KvPool
from refengine.models.kernels import Kernels, PreAttnArgs
from refengine.models.layers import DecoderLayerWeights, Rope


@dataclass
class MergedLayer:
    qkv: torch.Tensor  # [(nh + 2 nkv) d, H]: q_proj; k_proj; v_proj
    gate_up: torch.Tensor  # [2I, H]: gate_proj; up_proj
    w: DecoderLayerWeights  # o_proj, down_proj and the norms (its q/k/v/gate/up are views into the above)


def merge_layer(w: DecoderLayerWeights) -> MergedLayer:
    """Concatenate QKV and gate/up once, then rebind the layer's own tensors as views into the merged ones,
    so the eager path keeps working and no weight is stored twice."""
    qkv = torch.cat([w.q_proj, w.k_proj, w.v_proj])
    gate_up = torch.cat([w.gate_proj, w.up_proj])
    q, kv, i = w.q_proj.shape[0], w.k_proj.shape[0], w.gate_proj.shape[0]
    w.q_proj, w.k_proj, w.v_proj = qkv[:q], qkv[q : q + kv], qkv[q + kv :]
    w.gate_proj, w.up_proj = gate_up[:i], gate_up[i:]
    return MergedLayer(qkv, gate_up, w)


@dataclass
class ContextInputs:
    """The drafter graph's context rows: target features of newly committed positions, gathered from the
    feature store at `sources` and projected to every layer's K/V inside the graph (fc, hidden_norm, k_proj,
    k_norm, RoPE; v_proj), written at `slots`."""

    feats: torch.Tensor  # [rows, len(taps) * H_target]: the gathered features
    positions: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64 (padding rows: the dummy page)
    sources: torch.Tensor  # [rows] int64: the rows' target KV slots (their store rows; padding: a dummy slot)
    k: torch.Tensor  # [rows, nkv, d]: the normed k before its write (unfused kernels only)


@dataclass
class StepState:
    """The persistent buffers of one graph shape, `rows` rows each (a bucket's padded row count)."""

    ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64: KV slot of each row (padding rows: the pool's dummy page)
    score_index: torch.Tensor  # [S] int64: rows whose argmax is read
    hidden: torch.Tensor  # [rows, H]
    residual: torch.Tensor  # [rows, H]
    q: torch.Tensor  # [rows, nh, d]
    k: torch.Tensor  # [rows, nkv, d]: the normed k before its write (unfused kernels only)
    attn_out: torch.Tensor  # [rows, nh, d]
    taps: torch.Tensor | None  # [rows, len(taps) * H]: layer outputs handed to the drafter
    argmax: torch.Tensor  # [S] int64
    context: ContextInputs | None = None

    def head(self, rows: int) -> StepState:
        """Views of the first `rows` rows (the capture-shape rule switched off, in tests only)."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:rows]

        keep = self.score_index < rows
        return StepState(
            self.ids[:rows],
            self.positions[:rows],
            self.slots[:rows],
            self.score_index[keep],
            self.hidden[:rows],
            self.residual[:rows],
            self.q[:rows],
            self.k[:rows],
            self.attn_out[:rows],
            cut(self.taps),
            self.argmax[: int(keep.sum())],
        )

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        rows: int,
        score_index: torch.Tensor,
        num_taps: int,
        dtype: torch.dtype,
        device: torch.device,
        context_width: int = 0,
        zeroed: bool = True,
    ) -> StepState:
        """zeroed=False (an eager step: every row is real and written before it is read) skips the memsets."""
        make = torch.zeros if zeroed else torch.empty

        def z(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return make(*shape, dtype=dt, device=device)  # zeros for graphs: padding rows stay finite

        h, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        context = (
            None
            if not context_width
            else ContextInputs(
                z(rows, context_width),
                z(rows, dt=torch.long),
                z(rows, dt=torch.long),
                z(rows, dt=torch.long),
                z(rows, nkv, d),
            )
        )
        return cls(
            ids=z(rows, dt=torch.long),
            positions=z(rows, dt=torch.long),
            slots=z(rows, dt=torch.long),
            score_index=score_index.to(device),
            hidden=z(rows, h),
            residual=z(rows, h),
            q=z(rows, nh, d),
            k=z(rows, nkv, d),
            attn_out=z(rows, nh, d),
            taps=z(rows, num_taps * h) if num_taps else None,
            argmax=z(score_index.numel(), dt=torch.long),
            context=context,
        )


class SegmentedStack:
    """The segments of one model over one pool. `tap_layers`: layers whose outputs go to st.taps."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[MergedLayer],
        embed: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        rope: Rope,
        pool: KvPool,
        kernels: Kernels,
        tap_layers: tuple[int, ...] = (),
        context_proj: tuple[torch.Tensor, torch.Tensor] | None = None,
        feature_store: torch.Tensor | None = None,
    ):
        self.cfg, self.layers, self.embed, self.final_norm, self.lm_head = cfg, layers, embed, final_norm, lm_head
        self.pool, self.kernels, self.tap_layers = pool, kernels, tap_layers
        self.context_proj = context_proj  # the drafter's (fc [H, F*H], hidden_norm [H]): context rows in segment 0
        # the feature store's rows [slots, F*H] (spec_decode/feature_store.py): the target's segments write their
        # taps there at the rows' slots; the drafter's segment 0 gathers its context rows from it
        self.feature_store = feature_store
        half = cfg.head_dim // 2
        self.cos_sin = torch.cat([rope.cos[:, :half], rope.sin[:, :half]], dim=-1).float().contiguous()

    def segment(self, i: int, st: StepState, head: bool = True) -> None:
        """Run dense segment i (0..num_layers) on all of st's rows; head=False stops the last one at the final
        normed hidden rows (st.hidden), without the lm_head and argmax."""
        eps, n = self.cfg.rms_norm_eps, len(self.layers)
        if i == 0:
            if st.context is not None:
                self.project_context(st.context)
            st.residual.copy_(self.embed[st.ids])
            self.kernels.rmsnorm(st.residual, self.layers[0].w.input_norm, eps, out=st.hidden)
        else:
            self._post_attn(i - 1, st)
            norm = self.layers[i].w.input_norm if i < n else self.final_norm
            self.kernels.fused_add_rmsnorm(st.hidden, st.residual, norm, eps)  # residual = output of layer i-1
            if i - 1 in self.tap_layers and st.taps is not None:  # None: an eager step capturing nothing
                j, h = self.tap_layers.index(i - 1), self.cfg.hidden_size
                st.taps[:, j * h : (j + 1) * h].copy_(st.residual)
        if i == n and st.taps is not None and self.feature_store is not None:
            self.feature_store.index_copy_(0, st.slots, st.taps)  # padding rows: the dummy pages' slots
        if i < n:
            self._pre_attn(i, st)
        elif head:
            logits = F.linear(st.hidden[st.score_index], self.lm_head)  # [S, V]
            st.argmax.copy_(logits.argmax(-1))

    def run_eager(self, st: StepState, attend: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        """One forward of st's rows outside any graph (a prefill, a step no graph fits): the same segments with
        `attend(layer, q, out)` between them, ending at the final normed hidden rows in st.hidden (and the taps
        in st.taps when it has them); the caller reads the logits it needs. Merged QKV and gate/up weights and
        the fused kernels launch far fewer kernels than the layer-by-layer forward of models/qwen3.py."""
        n = len(self.layers)
        for i in range(n):
            self.segment(i, st)
            attend(i, st.q, st.attn_out)
        self.segment(n, st, head=False)

    def project_context(self, ctx: ContextInputs) -> None:
        """Context rows -> every layer's K/V in the pool (the drafter's context_kv, fused)."""
        assert self.context_proj is not None
        c, (fc, hidden_norm) = self.cfg, self.context_proj
        if self.feature_store is not None:
            torch.index_select(self.feature_store, 0, ctx.sources, out=ctx.feats)
        x = torch.empty(ctx.feats.shape[0], c.hidden_size, dtype=ctx.feats.dtype, device=ctx.feats.device)
        self.kernels.rmsnorm(F.linear(ctx.feats, fc), hidden_norm, c.rms_norm_eps, out=x)
        for i, layer in enumerate(self.layers):
            kv = F.linear(x, layer.qkv[c.q_dim :])  # [rows, 2 kvd]: k_proj; v_proj
            self.kernels.pre_attn(kv, self._pre_attn_args(i, ctx.positions, ctx.slots, None, ctx.k))

    def _pre_attn(self, i: int, st: StepState) -> None:
        qkv = F.linear(st.hidden, self.layers[i].qkv)  # [rows, qd + 2 kvd]
        self.kernels.pre_attn(qkv, self._pre_attn_args(i, st.positions, st.slots, st.q, st.k))

    def _pre_attn_args(
        self, i: int, positions: torch.Tensor, slots: torch.Tensor, q_out: torch.Tensor | None, k: torch.Tensor
    ) -> PreAttnArgs:
        c, w = self.cfg, self.layers[i].w
        cache = (c.num_kv_heads, c.head_dim)
        return PreAttnArgs(
            w.q_norm,
            w.k_norm,
            c.rms_norm_eps,
            positions,
            self.cos_sin,
            slots,
            q_out,
            k,
            self.pool.k[i].view(-1, *cache),
            self.pool.v[i].view(-1, *cache),
        )

    def _post_attn(self, i: int, st: StepState) -> None:
        layer, eps = self.layers[i], self.cfg.rms_norm_eps
        h = F.linear(st.attn_out.view(st.attn_out.shape[0], -1), layer.w.o_proj)
        self.kernels.fused_add_rmsnorm(h, st.residual, layer.w.post_norm, eps)
        torch.mm(self.kernels.silu_and_mul(F.linear(h, layer.gate_up)), layer.w.down_proj.t(), out=st.hidden)
