"""Configs: what the user sets (EngineConfig) and what checkpoints say (ModelConfig, DFlashConfig).

Every config is a frozen dataclass validated at construction, so a bad value fails before any weight loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.checkpoint_json import (  # noqa: F401  (read_config_json, read_stop_ids: re-exported)
    bool_field,
    check_int,
    field_error,
    int_field,
    json_kind,
    positive_float,
    read_config_json,
    read_stop_ids,
    token_ids_field,
    where_of,
)
from refengine.errors import CheckpointError, UnsupportedConfigError
from refengine.span_policy.base import SPAN_POLICIES

# The drafter lane projects pending context rows (fc -> hidden_norm -> per-layer K/V) this many at a time, so
# the transient is bounded however many long prompts were prefilled before a draft (memory.py bills it).
DRAFT_CONTEXT_FLUSH_ROWS = 4096

# Defaults shared by EngineConfig and `refengine memory`, so the CLI plans the setup the engine runs.
DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MEMORY_ACCOUNTING = "lane"
MEMORY_ACCOUNTINGS = ("upstream", "lane")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.90
GRAPH_MODES = ("eager", "piecewise", "full")
# Fused kernels of the graphed forwards: FlashInfer's, and pre_attn (q/k norm + RoPE + K/V write, one Triton kernel).
# pre_attn took 11% off a plain decode step on an H100 (docs/PERF.md, What made it fast); the default leaves it out
# until the GPU suite has passed with it in every graph mode (README: REFENGINE_FUSED_OPS)
FUSED_OPS = ("rmsnorm", "add_rmsnorm", "silu_and_mul", "rope", "pre_attn")
DEFAULT_FUSED_OPS = ("rmsnorm", "add_rmsnorm", "silu_and_mul", "rope")


def check_fused_ops(ops: tuple[str, ...]) -> None:
    """UnsupportedConfigError naming any op outside FUSED_OPS (EngineConfig and the --fused-ops option)."""
    bad = sorted(set(ops) - set(FUSED_OPS))
    if bad:
        raise UnsupportedConfigError(f"fused_ops {', '.join(bad)}: use a subset of {','.join(FUSED_OPS)}")


@dataclass(frozen=True)
class ModelConfig:
    """The Qwen3 geometry refengine needs, read from an HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise UnsupportedConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "target") -> ModelConfig:
        """Parse an HF config.json dict (read_config_json's names its file in every error). A wrong JSON type
        or an out-of-range value is a CheckpointError naming the file, field and value; a feature refengine
        does not implement is an UnsupportedConfigError."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{where} config.json must be a JSON object, got a JSON {json_kind(cfg)}")
        arch = cfg.get("architectures") or []
        if cfg.get("model_type") != "qwen3":
            raise UnsupportedConfigError(
                f"{where}: model_type={cfg.get('model_type')!r} ({arch}); refengine serves Qwen3 only"
            )
        if cfg.get("rope_scaling"):
            raise UnsupportedConfigError(f"{where}: rope_scaling={cfg['rope_scaling']} is not supported")
        rope = cfg.get("rope_parameters")  # the transformers 5 spelling of rope_theta + rope_scaling
        if rope is not None and not isinstance(rope, dict):
            raise field_error(cfg, where, "rope_parameters", rope, "an object")
        rope = rope or {}
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedConfigError(f"{where}: rope_parameters={rope} is not supported (default RoPE only)")
        if bool_field(cfg, where, "use_sliding_window", False):
            raise UnsupportedConfigError(f"{where}: sliding-window attention is not supported")
        if bool_field(cfg, where, "attention_bias", False):
            raise UnsupportedConfigError(f"{where}: attention_bias=true is not Qwen3")
        heads, hidden = int_field(cfg, where, "num_attention_heads"), int_field(cfg, where, "hidden_size")
        theta_key = "rope_theta" if cfg.get("rope_theta") is not None else "rope_parameters.rope_theta"
        theta = cfg["rope_theta"] if theta_key == "rope_theta" else rope.get("rope_theta")
        eps = cfg.get("rms_norm_eps")
        return cls(
            vocab_size=int_field(cfg, where, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=int_field(cfg, where, "intermediate_size"),
            num_layers=int_field(cfg, where, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int_field(cfg, where, "num_key_value_heads", default=heads),
            head_dim=int_field(cfg, where, "head_dim", default=hidden // heads),
            rms_norm_eps=positive_float(cfg, where, "rms_norm_eps", 1e-6 if eps is None else eps),
            rope_theta=positive_float(cfg, where, theta_key, 1000000.0 if theta is None else theta),
            max_position_embeddings=int_field(cfg, where, "max_position_embeddings"),
            tie_word_embeddings=bool_field(cfg, where, "tie_word_embeddings", False),
            eos_token_ids=token_ids_field(cfg, where, "eos_token_id"),
        )


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter: a Qwen3-style stack without embeddings or LM head, fed by target features."""

    model: ModelConfig  # the drafter's own layer geometry
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise UnsupportedConfigError(f"drafter block_size={self.block_size} must be >= 2")
        if not self.target_layer_ids:
            raise UnsupportedConfigError("drafter dflash_config.target_layer_ids is empty")

    @classmethod
    def from_hf(cls, cfg: dict) -> DFlashConfig:
        model = ModelConfig.from_hf(cfg, where="drafter")
        dcfg = cfg.get("dflash_config")
        if dcfg is not None and not isinstance(dcfg, dict):
            raise field_error(cfg, "drafter", "dflash_config", dcfg, "an object")
        dcfg = dcfg or {}
        block = cfg.get("block_size")  # top level in z-lab b16; nested in newer ones
        block = dcfg.get("block_size") if block is None else block
        if block is None:
            raise CheckpointError(f"{where_of(cfg, 'drafter')}: no block_size (top level or in dflash_config)")
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            raise CheckpointError(f"{where_of(cfg, 'drafter')}: lacks dflash_config.target_layer_ids")
        if not isinstance(ids, list):
            raise field_error(cfg, "drafter", "dflash_config.target_layer_ids", ids, "a list of layer ids >= 0")
        mask = dcfg.get("mask_token_id")
        if mask is None:
            raise CheckpointError(f"{where_of(cfg, 'drafter')}: lacks dflash_config.mask_token_id")
        return cls(
            model=model,
            block_size=check_int(cfg, "drafter", "block_size", block),
            mask_token_id=check_int(cfg, "drafter", "dflash_config.mask_token_id", mask, minimum=0),
            target_layer_ids=tuple(
                check_int(cfg, "drafter", f"dflash_config.target_layer_ids[{i}]", v, minimum=0)
                for i, v in enumerate(ids)
            ),
            num_target_layers=int_field(cfg, "drafter", "num_target_layers"),
        )

    def check_fits(self, target: ModelConfig) -> None:
        """Fail at load, naming the mismatch, when this drafter cannot serve `target`."""
        problems = []
        if self.model.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.model.hidden_size} != target {target.hidden_size}")
        if self.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target layers {target.num_layers}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside 0..{target.num_layers - 1}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target vocab (0..{target.vocab_size - 1})")
        if self.model.head_dim != target.head_dim:
            # not required by the maths, but every published pair shares it and the kernels assume it
            problems.append(f"head_dim {self.model.head_dim} != target {target.head_dim}")
        if problems:
            raise UnsupportedConfigError("drafter does not fit its target: " + "; ".join(problems))


def max_context_tokens(target: ModelConfig, drafter: DFlashConfig | None, max_model_len: int | None = None) -> int:
    """The longest prompt + max_tokens a request may have: the target's window; with DFlash on, the drafter's
    in-fill block writes B positions past the committed length, so its window minus B bounds it too.
    `max_model_len` caps both. The one place this rule lives (admission and the planner both call it)."""
    limit = target.max_position_embeddings
    if drafter is not None:
        limit = min(limit, drafter.model.max_position_embeddings - drafter.block_size)
    return min(limit, max_model_len or limit)


SPECULATION_MODES = tuple(SPAN_POLICIES)  # the span policies by name (refengine/span_policy/base.py)
DRAFT_SAMPLINGS = ("sampled", "greedy")  # how a sampling request drafts (EngineConfig.draft_sampling)


@dataclass(frozen=True)
class EngineConfig:
    """User knobs. `device` 'cpu' runs fp32 with the torch attention backend; 'cuda' bf16 with FlashInfer."""

    target_path: str
    draft_path: str | None = None
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on cpu, bfloat16 on cuda
    attention_backend: str | None = None  # "torch" | "flashinfer"; default by device
    page_size: int = DEFAULT_PAGE_SIZE
    num_blocks: int | None = None  # default: planned from device memory (cuda) or CPU_KV_BYTES (cpu)
    # cuda: the share of total memory the process may use (planned, then enforced as a cap on torch's
    # caching allocator)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # DFlash reservation: "lane" (what this engine allocates) or "upstream" (upstream's formula)
    memory_accounting: str = DEFAULT_MEMORY_ACCOUNTING
    max_model_len: int | None = None  # cap on prompt + max_tokens (default: the models' window). On CUDA
    # the planner profiles the longest forward the engine may run,
    # max(max_prefill_tokens, context): cap it on small devices
    synthetic_weights: bool = False  # random weights from config.json alone (benchmarks, memory tests)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_prefill_tokens: int = 8192
    speculative: bool = True  # use the drafter when one is given
    # Block prefix cache of the target's KV (refengine/kv/prefix_cache.py): a prompt's cached full blocks are
    # shared, not prefilled; blocks carry their tap features, so a drafting request's hit brings its drafter
    # context (scheduler/prefix.py).
    enable_prefix_caching: bool = False
    # "fixed": every verify span is min(B, remaining); "adaptive": GoodputSpans picks each request's span
    # (1..B) per step from measured step costs and its acceptance (refengine/span_policy/; output unchanged)
    speculation: str = "fixed"
    # A sampling request's drafts (temperature > 0): "sampled", drawn from the drafter's processed
    # distribution q; "greedy", its argmax (q one-hot). Either is lossless; they accept differently.
    draft_sampling: str = "sampled"
    # Benchmark-only acceptance profiles (outputs stop being greedy-exact) cannot be set here: only
    # `refengine bench --acceptance-profile` enables them. Any value is refused.
    acceptance_profile: str | None = None
    # CUDA graphs for decode, verify and draft steps: "eager" (none), "piecewise" (dense segments captured,
    # attention eager between them) or "full" (attention inside the graph, re-planned before each replay).
    # Default: "full" on CUDA, "eager" on the CPU (where graph modes run with a fake capturer, for tests).
    graph_mode: str | None = None
    # Fused kernels the graphed forwards use on CUDA (None: DEFAULT_FUSED_OPS); the rest run as torch ops.
    # A measuring knob: each fused kernel's gain is in docs/PERF.md.
    fused_ops: tuple[str, ...] | None = None
    # Tensor parallel (refengine/parallel): the target sharded over this many processes (rank 0 = the calling
    # process, which schedules and hosts the drafter); 1 or a divisor of the target's head counts, checked at
    # load. tensor_parallel_timeout_s bounds every collective and the workers' start-up: a rank that dies or
    # hangs fails the engine with TensorParallelError instead of hanging it.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise UnsupportedConfigError(f"device={self.device!r}: use 'cpu' or 'cuda[:N]'")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise UnsupportedConfigError(f"dtype={self.dtype!r}: use float32, bfloat16 or float16")
        if self.attention_backend not in (None, "torch", "flashinfer"):
            raise UnsupportedConfigError(f"attention_backend={self.attention_backend!r}: use 'torch' or 'flashinfer'")
        if self.attention_backend == "flashinfer" and not self.device.startswith("cuda"):
            raise UnsupportedConfigError("attention_backend='flashinfer' needs device='cuda'")
        if self.page_size <= 0 or self.max_num_seqs <= 0 or self.max_prefill_tokens <= 0:
            raise UnsupportedConfigError("page_size, max_num_seqs and max_prefill_tokens must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise UnsupportedConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        check_fused_ops(self.fused_ops or ())
        if self.graph_mode not in (None, *GRAPH_MODES):
            raise UnsupportedConfigError(f"graph_mode={self.graph_mode!r}: use one of {GRAPH_MODES}")
        if self.memory_accounting not in MEMORY_ACCOUNTINGS:
            raise UnsupportedConfigError(f"memory_accounting={self.memory_accounting!r}: use 'upstream' or 'lane'")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise UnsupportedConfigError(f"max_model_len={self.max_model_len} must be positive")
        if self.speculation not in SPECULATION_MODES:
            raise UnsupportedConfigError(f"speculation={self.speculation!r}: use one of {SPECULATION_MODES}")
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise UnsupportedConfigError(f"draft_sampling={self.draft_sampling!r}: use one of {DRAFT_SAMPLINGS}")
        if self.acceptance_profile is not None:
            raise UnsupportedConfigError(
                f"acceptance_profile={self.acceptance_profile!r}: acceptance profiles are a benchmark-only mode "
                "(outputs are not greedy-exact); use `refengine bench --acceptance-profile NAME`"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise UnsupportedConfigError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise UnsupportedConfigError(f"num_blocks={self.num_blocks} must be positive")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise UnsupportedConfigError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be an int >= 1")
        if not self.tensor_parallel_timeout_s > 0:
            raise UnsupportedConfigError(
                f"tensor_parallel_timeout_s={self.tensor_parallel_timeout_s} must be positive (seconds)"
            )
        if self.tensor_parallel_size > 1 and self.graph_mode_name != "eager":
            raise UnsupportedConfigError(
                f"graph_mode={self.graph_mode!r} with tensor_parallel_size={self.tensor_parallel_size}: graph modes "
                "are tensor-parallel size 1 only for now; use graph_mode='eager'"
            )

    @property
    def torch_dtype_name(self) -> str:
        return self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32")

    @property
    def fused_ops_names(self) -> tuple[str, ...]:
        return DEFAULT_FUSED_OPS if self.fused_ops is None else self.fused_ops

    @property
    def fused_ops_run(self) -> tuple[str, ...]:
        """The fused kernels the graphed forwards run: fused_ops_names on CUDA, none elsewhere (torch ops)."""
        return self.fused_ops_names if self.device.startswith("cuda") else ()

    @property
    def graph_mode_name(self) -> str:
        # tensor parallel runs eager by default (graph modes are tp 1 only for now)
        cuda = self.device.startswith("cuda") and self.tensor_parallel_size == 1
        return self.graph_mode or ("full" if cuda else "eager")

    @property
    def backend_name(self) -> str:
        return self.attention_backend or ("flashinfer" if self.device.startswith("cuda") else "torch")
