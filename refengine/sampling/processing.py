"""Logits processing for sampling, in HF `generate`'s order: temperature, then top-k, then top-p; written once
and used for the target's rows (plain decode, prefill, verify) and the drafter's.

Semantics (golden/distribution/processing.py is the float64 reference the tests hold this to):
  * logits / T (T > 0; a greedy request is never processed);
  * top-k (k >= 1, 0 = off): keep every token whose logit is >= the k-th largest, so ties at the boundary
    are all kept, as HF does;
  * top-p (0 < p <= 1, 1 = off): on the top-k softmax keep the smallest set of most probable tokens whose mass
    reaches p (at least one), ties ordered by lower token id first;
  * softmax over the kept tokens, zeros elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refengine.request import SamplingParams


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [R, V] (any float dtype), one SamplingParams per row (temperature > 0) -> probs [R, V] fp32."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(params)} rows of sampling parameters")
    dev, v = logits.device, logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    x = logits.float() / temps[:, None]
    ks = [p.top_k for p in params if 0 < p.top_k < v]
    if ks:  # the k-th largest logit of each row that filters (the others keep everything)
        k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=dev)
        top = x.topk(max(ks), dim=-1).values  # [R, max k]
        kth = top.gather(-1, (k.clamp(max=max(ks)) - 1)[:, None])
        kth = torch.where((k < v)[:, None], kth, torch.full_like(kth, -torch.inf))
        x = x.masked_fill(x < kth, -torch.inf)
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        # probability descending; a stable sort of -p keeps tied tokens in id order
        sorted_p, order = torch.sort(-probs, dim=-1, stable=True)
        sorted_p = -sorted_p
        above = sorted_p.double().cumsum(-1) - sorted_p.double()  # mass strictly above each token
        keep_sorted = above < top_p.double()[:, None]
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token at uniform u in [0, 1) per row: the first id whose cumulative mass (in id order, float64)
    exceeds u x the row's total, so a zero-probability token is never drawn. probs [R, V], u [R] -> [R] int64."""
    cdf = probs.double().cumsum(-1)  # [R, V]
    x = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
