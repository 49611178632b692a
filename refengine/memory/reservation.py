"""DFlash memory reservation: what the drafter needs outside the paged KV pool, from config.json alone.

The drafter's weights and per-request buffers do not live in the target's paged KV pool, so they are
reserved before the pool is sized, split by how they scale:

* per-token bytes grow with the tokens the pool holds; the planner folds them into
  ``effective_bytes_per_block = bytes_per_block + per_token_bytes * page_size``, so the block count shrinks
  while the pool itself is still allocated at the target-only ``bytes_per_block``;
* fixed bytes do not; the planner adds them to the KV margin.

Two accountings (symbols below: b = dtype bytes, Ld = drafter layers, Hd / Ht = drafter / target hidden,
kv = kv_heads * head_dim, Q = heads * head_dim, I = drafter intermediate, V = vocab, n = len(target_layer_ids),
B = block size, N = max decode batch):

``"upstream"`` is pegainfer's ``DFlashMemoryReservation::from_config``, term for term: a safe upper bound
for upstream's engine, kept from when its drafter scratch was per-request. It is not a bound for refengine's
lane (for small pools its per-token context scratch does not cover one projection chunk), so the engine
plans with ``"lane"`` by default; ``"upstream"`` is here to reproduce and compare upstream's figures.
    per token: draft KV  Ld*2*kv*b | context scratch 2*Hd*b | tail scratch (Hd+2kv)*b | pending Ht*n*b
    fixed:     weights b*(Ld*(Hd*(Q+2kv) + Q*Hd + 3*Hd*I) + Hd*Ht*n) + weights//10 slack
               + dense scratch b*(5Hd+2Q+3I)*B*N + logits scratch b*V*B*N
               + block headroom N*B*(draft KV + tail scratch)

``"lane"`` bills exactly what refengine's drafter lane allocates. Per request it keeps, for each drafter
layer, context K and V as [capacity, nkv, d], where capacity = prompt + max_tokens + B rows; target
features wait in the feature store, a row of n*Ht per token of the target's pool (the `pending` term, the
store's size exactly: spec_decode/feature_store.py; it bills the rows of prefix-cached blocks too, which is
what a prefix-cache hit hands the drafter as its context: kv/prefix_cache.py); one batch scratch is shared
by all requests: hidden [N*B, Hd], q [N*B, Q], k and v [N*B, kv], MLP gate and up [N*B, I], logits for block
rows 1..B-1 [N*(B-1), V].
    per token: draft KV  Ld*2*kv*b | pending Ht*n*b           (context and tail scratch: 0)
    fixed:     the same weights + slack
               + dense scratch b*(Hd+Q+2kv+2I)*B*N + logits scratch b*V*(B-1)*N
               + block headroom N*B*(draft KV + pending)    (the capacity's B rows past the lifetime)
               + context flush scratch R*(pending + 2*Hd*b + 3*Hd*4 + 2*kv*4 + draft KV), R = 4096 rows
                 projected at a time (refengine.config.DRAFT_CONTEXT_FLUSH_ROWS)
The pool reserves ceil((prompt + max_tokens) / page) pages for a request's whole life, so the per-token
term covers the first prompt + max_tokens capacity rows and the headroom the last B, for up to N requests.

The planner that consumes this reservation is ``refengine.memory.planner``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refengine.config import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MEMORY_ACCOUNTING,
    DEFAULT_PAGE_SIZE,
    DRAFT_CONTEXT_FLUSH_ROWS,
    MEMORY_ACCOUNTINGS,
    DFlashConfig,
    ModelConfig,
    max_context_tokens,
    read_config_json,
)
from refengine.errors import UnsupportedConfigError

ACCOUNTINGS = MEMORY_ACCOUNTINGS
PER_TOKEN_TERMS = (
    "draft_kv_bytes_per_token",
    "context_scratch_bytes_per_token",
    "tail_scratch_bytes_per_token",
    "pending_features_bytes_per_token",
)
FIXED_TERMS = (
    "drafter_weights_bytes",
    "weights_slack_bytes",
    "batch_dense_scratch_bytes",
    "batch_logits_scratch_bytes",
    "block_headroom_bytes",
    "context_flush_scratch_bytes",
)
ConfigSource = Mapping[str, Any] | str | os.PathLike


def load_config(source: ConfigSource) -> dict:
    """A config.json as a dict: given as a dict, a checkpoint directory, or the config.json file."""
    if isinstance(source, Mapping):
        return dict(source)
    return read_config_json(Path(source))


def target_kv_bytes_per_block(target: ModelConfig, page_size: int, dtype_bytes: int = 2) -> int:
    """What one pool block costs: K and V of every target layer for `page_size` tokens."""
    return target.num_layers * 2 * target.num_kv_heads * target.head_dim * page_size * dtype_bytes


def target_weight_bytes(target: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of the target's weights as stored (the tied LM head counted once)."""
    h, q, kv, inter = target.hidden_size, target.q_dim, target.kv_dim, target.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h + 2 * target.head_dim  # + 4 RMSNorm weights
    embeddings = target.vocab_size * h * (1 if target.tie_word_embeddings else 2)
    return dtype_bytes * (target.num_layers * per_layer + embeddings + h)  # + final norm


@dataclass(frozen=True)
class DFlashMemoryReservation:
    """The drafter's out-of-pool footprint, every term named (formulas in the module docstring).

    Qwen3-4B + DFlash-b16, page 16, decode batch 256, bf16, upstream accounting: per token
    20,480 + 10,240 + 9,216 + 25,600 = 65,536 B; fixed 1,074,790,400 + 107,479,040 + 411,041,792
    + 1,244,659,712 + 121,634,816 = 2,959,605,760 B; bytes_per_block 2,359,296 -> effective 3,407,872.
    """

    accounting: str
    dtype_bytes: int
    page_size: int
    max_decode_batch: int
    block_size: int
    max_context_tokens: int  # min(target MPE, drafter MPE - block_size)
    target_bytes_per_block: int  # what a pool block really costs (target K/V only)
    # per-token: scale with the pool
    draft_kv_bytes_per_token: int  # context K and V of every drafter layer
    context_scratch_bytes_per_token: int  # upstream: context_projected + context_hidden; lane: 0
    tail_scratch_bytes_per_token: int  # upstream: tail_input + k_tail + v_tail; lane: 0
    pending_features_bytes_per_token: int  # target features at the tap layers, not yet projected
    # fixed: do not scale with the pool
    drafter_weights_bytes: int  # linear weights only; norms are inside the slack
    weights_slack_bytes: int  # +10%: norms, RoPE tables, allocator alignment
    batch_dense_scratch_bytes: int  # hidden / q / k / v / MLP rows of one N*B draft pass
    batch_logits_scratch_bytes: int  # draft logits of one N*B pass (the largest term)
    block_headroom_bytes: int  # N requests x B rows sized past the pool-billed lifetime
    context_flush_scratch_bytes: int = 0  # lane: one chunk of pending rows being projected (upstream: 0,
    # its per-token context scratch covers it)

    def __post_init__(self) -> None:
        if self.accounting not in ACCOUNTINGS:
            raise UnsupportedConfigError(f"accounting={self.accounting!r}: use one of {ACCOUNTINGS}")
        for name in ("dtype_bytes", "page_size", "max_decode_batch", "max_context_tokens", "target_bytes_per_block"):
            if getattr(self, name) <= 0:
                raise UnsupportedConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.block_size < 2:
            raise UnsupportedConfigError(f"drafter block_size={self.block_size} must be >= 2")
        for name, value in self.terms().items():
            if not isinstance(value, int) or value < 0:
                raise UnsupportedConfigError(f"reservation term {name}={value!r} must be a non-negative int")
        if self.accounting == "lane" and (self.context_scratch_bytes_per_token or self.tail_scratch_bytes_per_token):
            raise UnsupportedConfigError("lane accounting has no per-request context or tail scratch")

    # -- totals ---------------------------------------------------------------------------------------------
    @property
    def per_token_bytes(self) -> int:
        return sum(getattr(self, name) for name in PER_TOKEN_TERMS)

    @property
    def fixed_bytes(self) -> int:
        return sum(getattr(self, name) for name in FIXED_TERMS)

    @property
    def effective_bytes_per_block(self) -> int:
        """A pool block plus the drafter bytes its tokens drag along outside the pool."""
        return self.target_bytes_per_block + self.per_token_bytes * self.page_size

    @property
    def effective_factor(self) -> float:
        return self.effective_bytes_per_block / self.target_bytes_per_block

    def terms(self) -> dict[str, int]:
        """Every byte term by name, per-token ones first (for printing and JSON)."""
        return {name: getattr(self, name) for name in PER_TOKEN_TERMS + FIXED_TERMS}

    # -- what it covers ---------------------------------------------------------------------------------
    def pool_billed_tokens(self, lifetimes: Sequence[int]) -> int:
        """Tokens the pool reserves for requests of these lifetimes (prompt + max_tokens): whole pages."""
        return sum(math.ceil(n / self.page_size) * self.page_size for n in lifetimes)

    def buffers_reserved_bytes(self, lifetimes: Sequence[int]) -> int:
        """Bytes reserved for the drafter's buffers (everything but weights) when these requests are live."""
        if len(lifetimes) > self.max_decode_batch:
            raise ValueError(
                f"{len(lifetimes)} live requests exceed the reservation's decode batch {self.max_decode_batch}"
            )
        if any(n <= 0 for n in lifetimes):
            raise ValueError(f"lifetimes must be positive, got {list(lifetimes)}")
        buffers_fixed = self.fixed_bytes - self.drafter_weights_bytes - self.weights_slack_bytes
        return buffers_fixed + self.per_token_bytes * self.pool_billed_tokens(lifetimes)

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        target_config: ConfigSource,
        draft_config: ConfigSource,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_decode_batch: int = DEFAULT_MAX_NUM_SEQS,
        dtype_bytes: int = 2,
        accounting: str = DEFAULT_MEMORY_ACCOUNTING,
    ) -> DFlashMemoryReservation:
        """Read the two config.json files (dicts, checkpoint directories or files) and nothing else."""
        target = ModelConfig.from_hf(load_config(target_config), where="target")
        drafter = DFlashConfig.from_hf(load_config(draft_config))
        drafter.check_fits(target)
        return cls.from_models(
            target,
            drafter,
            page_size=page_size,
            max_decode_batch=max_decode_batch,
            dtype_bytes=dtype_bytes,
            accounting=accounting,
        )

    @classmethod
    def from_models(
        cls,
        target: ModelConfig,
        drafter: DFlashConfig,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_decode_batch: int = DEFAULT_MAX_NUM_SEQS,
        dtype_bytes: int = 2,
        accounting: str = DEFAULT_MEMORY_ACCOUNTING,
    ) -> DFlashMemoryReservation:
        if accounting not in ACCOUNTINGS:
            raise UnsupportedConfigError(f"accounting={accounting!r}: use one of {ACCOUNTINGS}")
        if page_size <= 0 or max_decode_batch <= 0 or dtype_bytes <= 0:
            raise UnsupportedConfigError(
                f"page_size={page_size}, max_decode_batch={max_decode_batch} and "
                f"dtype_bytes={dtype_bytes} must be positive"
            )
        d, b = drafter.model, dtype_bytes
        hd, ht, kv, q, inter = d.hidden_size, target.hidden_size, d.kv_dim, d.q_dim, d.intermediate_size
        n_taps, block, rows = len(drafter.target_layer_ids), drafter.block_size, drafter.block_size * max_decode_batch
        vocab = target.vocab_size  # draft logits come from the target's LM head

        draft_kv = d.num_layers * 2 * kv * b
        pending = ht * n_taps * b
        per_layer = hd * (q + 2 * kv) + q * hd + 2 * hd * inter + inter * hd  # qkv, o, gate+up, down
        weights = b * (d.num_layers * per_layer + hd * ht * n_taps)  # + fc (context projection)
        if accounting == "upstream":
            context_scratch, tail_scratch = 2 * hd * b, (hd + 2 * kv) * b
            dense = b * (5 * hd + 2 * q + 3 * inter) * rows
            logits = b * vocab * rows
            headroom = rows * (draft_kv + tail_scratch)
        else:
            context_scratch = tail_scratch = 0
            dense = b * (hd + q + 2 * kv + 2 * inter) * rows  # hidden, q, k, v, gate, up
            logits = b * vocab * (block - 1) * max_decode_batch  # block row 0 is the known token
            headroom = rows * (draft_kv + pending)
            # one chunk of R pending rows in projection: the features gathered from the store, fc output, the fp32
            # temporaries of hidden_norm (3 x Hd fp32) and of each k_norm (2 x kv fp32), every layer's K and V
            flush = DRAFT_CONTEXT_FLUSH_ROWS * (pending + 2 * hd * b + 3 * hd * 4 + 2 * kv * 4 + draft_kv)
        return cls(
            accounting=accounting,
            dtype_bytes=b,
            page_size=page_size,
            max_decode_batch=max_decode_batch,
            block_size=block,
            max_context_tokens=max_context_tokens(target, drafter),
            target_bytes_per_block=target_kv_bytes_per_block(target, page_size, b),
            draft_kv_bytes_per_token=draft_kv,
            context_scratch_bytes_per_token=context_scratch,
            tail_scratch_bytes_per_token=tail_scratch,
            pending_features_bytes_per_token=pending,
            drafter_weights_bytes=weights,
            weights_slack_bytes=weights // 10,
            batch_dense_scratch_bytes=dense,
            batch_logits_scratch_bytes=logits,
            block_headroom_bytes=headroom,
            context_flush_scratch_bytes=0 if accounting == "upstream" else flush,
        )
