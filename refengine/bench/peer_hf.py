"""`refengine bench --peer hf`: HF transformers `generate` (greedy, same checkpoint shapes, same prompts,
same dtype / device) measured in the same run, so every table carries refengine and HF side by side.

Synthetic weights (or a config-only directory): the HF model is built from config.json with random init
(AutoModelForCausalLM.from_config). `--peer-compile`: static cache + torch.compile(mode="reduce-overhead");
if that fails the row falls back to eager and its label says so. transformers is the `golden` extra,
imported only here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from refengine.bench.prompts import make_prompts
from refengine.bench.report import aggregate, throughput_fields
from refengine.errors import UnsupportedConfigError


def load_hf(target: str, *, dtype: torch.dtype, device: str, synthetic: bool):
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise UnsupportedConfigError("--peer hf needs transformers: pip install 'refengine[golden]'") from e
    has_weights = any(Path(target).glob("*.safetensors"))
    if synthetic or not has_weights:
        cfg = AutoConfig.from_pretrained(target)
        with torch.device(device):  # random init on the device itself (a 4B model inits slowly on the CPU)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    return model.to(device).eval()


def _batch(prompts: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (pad id 0, masked out)."""
    n = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _generate(model, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[int, float]:
    ids, mask = _batch(prompts, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (out.shape[1] - ids.shape[1]) * len(prompts), time.perf_counter() - t0


def make_peer(target: str, *, dtype: torch.dtype, device: str, synthetic: bool, compile: bool):
    """(model, label): label is 'hf eager' or 'hf static+compile' (or the eager fallback, saying why)."""
    model = load_hf(target, dtype=dtype, device=device, synthetic=synthetic)
    label = "hf eager"
    if compile:
        try:
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward, mode="reduce-overhead")
            _generate(model, [[1, 2, 3, 4]], 4, device)
            label = "hf static+compile"
        except Exception as e:  # noqa: BLE001 - any compile failure falls back, labelled
            model = load_hf(target, dtype=dtype, device=device, synthetic=synthetic)
            label = f"hf eager (compile failed: {type(e).__name__})"
    return model, label


def peer_row(model, label: str, prompts: list[list[int]], new_tokens: int, device: str, floor: float) -> dict[str, Any]:
    tokens, secs = _generate(model, prompts, new_tokens, device)
    return {"mode": "hf", "acceptance": "-", "peer": label, **throughput_fields(tokens, secs, len(prompts), floor)}


def peer_rows(results: dict[str, Any], concurrency, compile: bool, floor: float, vocab: int, seed: int, bar) -> None:
    """HF `generate` rows on the run's checkpoint, prompts, lengths and repeats (read back from `results`)."""
    from refengine.config import EngineConfig

    target, device, prompts = results["target"], results["device"], results["prompts"]
    prompt_len, output_tokens, repeats = results["prompt_len"], results["output_tokens"], results["repeats"]
    dtype = getattr(torch, EngineConfig(target, device=device).torch_dtype_name)
    model, label = make_peer(
        target, dtype=dtype, device=device, synthetic=results["synthetic_weights"], compile=compile
    )
    for c in concurrency:
        batch = make_prompts(prompts, c, prompt_len, vocab, target, seed)
        peer_row(model, label, batch, min(output_tokens, 8), device, floor)  # warm-up
        runs = []
        for _ in range(repeats):
            runs.append(peer_row(model, label, batch, output_tokens, device, floor))
            bar.update()
        results["rows"].append(aggregate(runs))
