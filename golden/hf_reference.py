"""HuggingFace transformers as the oracle: teacher-forced top-k, plain greedy, target tap features.

Everything runs one sequence at a time (batch 1, no padding, so no attention-mask subtleties), with
`attn_implementation="eager"`, fp32 on CPU unless a dtype is given. Models load from local directories
only (HF_HUB_OFFLINE=1) and are cached per (directory, dtype, device).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network, whatever the caller forgot

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from golden.records import GreedyRecord, TopKRecord

DEFAULT_K = 20


@functools.lru_cache(maxsize=8)
def _load(model_dir: str, dtype: torch.dtype, device: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", local_files_only=True
    )
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' .to() typing wraps the device


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """The HF model for `model_dir`, loaded once per (resolved dir, dtype, device)."""
    return _load(str(Path(model_dir).resolve()), dtype, device)


def _ids_tensor(ids: Sequence[int], device: str) -> torch.Tensor:
    if len(ids) == 0:
        raise ValueError("empty token sequence")
    return torch.tensor([list(ids)], dtype=torch.long, device=device)  # [1, n]


def _topk_record(name: str, ids: Sequence[int], logits: torch.Tensor, k: int) -> TopKRecord:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V], fp32 whatever the model dtype
    values, indices = torch.topk(logprobs, k, dim=-1)  # [n, k] each, sorted descending
    return TopKRecord(name=name, token_ids=list(ids), topk_ids=indices.tolist(), topk_logprobs=values.tolist())


@torch.inference_mode()
def teacher_forced_topk(
    model_dir: str | Path,
    sequences: Mapping[str, Sequence[int]],
    k: int = DEFAULT_K,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> list[TopKRecord]:
    """One forward per sequence; row p = top-k logprobs of the next token after ids[:p+1]."""
    model = load_model(model_dir, dtype, device)
    records = []
    for name, ids in sequences.items():
        logits = model(_ids_tensor(ids, device), use_cache=False).logits[0]  # [n, V]
        records.append(_topk_record(name, ids, logits, k))
    return records


def score_fn(
    model_dir: str | Path, k: int = DEFAULT_K, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Callable[[Sequence[int]], TopKRecord]:
    """A `score_fn` for gates.first_divergence_regret_gate: ids -> teacher-forced TopKRecord."""

    def score(ids: Sequence[int]) -> TopKRecord:
        return teacher_forced_topk(model_dir, {"score": ids}, k=k, dtype=dtype, device=device)[0]

    return score


def _eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(t) for t in eos_token_id)


@torch.inference_mode()
def greedy_ids(
    model_dir: str | Path,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> list[int]:
    """Plain greedy with HF's KV cache: prefill, then one token per forward. Stops after an EOS
    (which is kept) or after max_new_tokens. No generation_config is consulted: this is the bare loop."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    model = load_model(model_dir, dtype, device)
    eos = _eos_set(eos_token_id)
    # transformers 5.x renamed past_key_values to cache (the old name warns); support both spellings.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(_ids_tensor(prompt_ids, device), use_cache=True)
    generated: list[int] = []
    while True:
        token = int(out.logits[0, -1].float().argmax())
        generated.append(token)
        if token in eos or len(generated) >= max_new_tokens:
            return generated
        cache = getattr(out, "cache", None)
        cache = out.past_key_values if cache is None else cache
        out = model(torch.tensor([[token]], device=device), use_cache=True, **{cache_kw: cache})


def greedy(
    model_dir: str | Path,
    prompts: Mapping[str, Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> list[GreedyRecord]:
    """greedy_ids for each named prompt; eos_token_id=None runs every prompt to max_new_tokens."""
    return [
        GreedyRecord(
            name=name,
            prompt_ids=list(ids),
            output_ids=greedy_ids(model_dir, ids, max_new_tokens, eos_token_id, dtype, device),
        )
        for name, ids in prompts.items()
    ]


@torch.inference_mode()
def target_forward(
    model_dir: str | Path,
    ids: Sequence[int],
    layer_ids: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One dense forward: (logits [n, V], tap features [n, len(layer_ids) * H]).

    The tap for id L is the *output of decoder layer L* (residual stream, before the final norm), which is
    HF's hidden_states[L+1] for every L except the last layer, where HF hands back the post-norm state
    instead. A forward hook on layer L reads the right tensor for every L.
    """
    model = load_model(model_dir, dtype, device)
    layers = model.model.layers
    for layer_id in layer_ids:
        if not 0 <= layer_id < len(layers):
            raise ValueError(f"tap layer {layer_id} outside the target's {len(layers)} layers")
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id: int):
        def hook(_module, _args, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output  # [1, n, H]

        return hook

    handles = [layers[L].register_forward_hook(hook_for(L)) for L in set(layer_ids)]
    try:
        logits = model(_ids_tensor(ids, device), use_cache=False).logits[0]  # [n, V]
    finally:
        for h in handles:
            h.remove()
    features = torch.cat([captured[L][0] for L in layer_ids], dim=-1)  # [n, F*H], list order
    return logits, features


def target_features(
    model_dir: str | Path,
    ids: Sequence[int],
    layer_ids: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> torch.Tensor:
    """Concat of the outputs of target layers `layer_ids` (HF hidden_states[L+1]): [n, len(layer_ids) * H]."""
    return target_forward(model_dir, ids, layer_ids, dtype, device)[1]
