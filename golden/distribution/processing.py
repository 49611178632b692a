"""Logits processing, the reference: temperature, then top-k, then top-p (HF `generate`'s warper order).

Semantics, exactly (the gate's conditionals and the exact enumeration both use these):
  * temperature T > 0: logits / T. T == 0 is greedy and is not a distribution: use a one-hot instead.
  * top-k (k >= 1, 0 = off): keep every token whose (tempered) logit is >= the k-th largest logit, so
    ties AT the boundary are all kept (HF: `scores < topk(scores, k).values[-1]` are removed). More than k
    tokens may survive when the k-th value is tied.
  * top-p (0 < p <= 1, 1 = off): on the top-k-filtered softmax, keep the SMALLEST set of most probable
    tokens whose mass is >= p, always at least one token. Order: probability descending, ties broken by
    lower token id first (HF sorts with torch.sort, whose tie order is unspecified; a tie straddling the
    top-p boundary is the only place the two may differ). HF removes a token when the mass of the tokens
    sorted strictly above it is >= p, which is the same set. A mass landing exactly on p is float-sensitive
    (0.5 + 0.3 vs 0.8) in both.
  * the result is softmax over the kept tokens, zeros elsewhere (float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from golden.errors import GoldenError


class SamplingConfigError(GoldenError):
    """A sampling configuration out of range (temperature <= 0, top_k < 0, top_p outside (0, 1])."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and np.isfinite(self.temperature)):
            raise SamplingConfigError(f"temperature must be > 0 and finite (greedy is one-hot), got {self.temperature}")
        if self.top_k < 0:
            raise SamplingConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingConfigError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    e = np.zeros_like(x)
    e[finite] = np.exp(x[finite] - x[finite].max())
    return e / e.sum()


def process_logits(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """The sampling distribution of one row of logits [V] under `cfg` (see the module docstring)."""
    x = np.asarray(logits, dtype=np.float64) / cfg.temperature
    if x.ndim != 1 or x.size == 0:
        raise SamplingConfigError(f"want one non-empty row of logits, got shape {x.shape}")
    if cfg.top_k and cfg.top_k < x.size:
        kth = np.sort(x)[::-1][cfg.top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    probs = softmax(x)
    if cfg.top_p < 1.0:
        order = np.lexsort((np.arange(x.size), -probs))  # probability descending, then lower id first
        above = np.concatenate(([0.0], np.cumsum(probs[order])[:-1]))  # mass strictly above each token
        keep = np.zeros(x.size, dtype=bool)
        keep[order[above < cfg.top_p]] = True
        keep[order[0]] = True
        probs = np.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def one_hot(v: int, index: int) -> np.ndarray:
    out = np.zeros(v, dtype=np.float64)
    out[index] = 1.0
    return out


def rank_order(probs: np.ndarray) -> np.ndarray:
    """Token ids by probability descending, ties by lower id first: the order the gate's PIT uses."""
    p = np.asarray(probs, dtype=np.float64)
    return np.lexsort((np.arange(p.size), -p))


def cdf_step(probs: np.ndarray, token: int) -> tuple[float, float]:
    """(cdf_below, prob) of `token` for the gate's records: the mass of the tokens ranked before it in
    rank_order (more probable, or as probable with a lower id), and its own probability."""
    p = np.asarray(probs, dtype=np.float64)
    before = (p > p[token]) | ((p == p[token]) & (np.arange(p.size) < token))
    return float(p[before].sum()), float(p[token])
