"""The picks of sampling requests (temperature > 0), from the target's final normed rows: a prefill's or a
decode step's row is drawn from the processed distribution; a verify's rows go through speculative sampling
(refengine/spec_decode/accept_sampled.py) against drafts the drafter sampled from its own processed
distribution (`sample_drafts`), or greedy drafts (q one-hot). Every uniform comes from the request's stream
(refengine/sampling/streams.py), keyed by the position the token decides: row j of a step starting at the
current token's position `start` decides position start + 1 + j.

Greedy requests keep the argmax the runner already has; this module touches only the sampling ones.
"""

from __future__ import annotations

import numpy as np
import torch

from refengine.request import Request
from refengine.sampling.processing import processed_probs, sample_inverse_cdf
from refengine.sampling.streams import ACCEPT, DRAFT, FINAL, uniform_rows
from refengine.spec_decode.accept_sampled import accept_speculative


def _stream(reqs: list[Request], starts: list[int], width: int, purpose: int) -> np.ndarray:
    """[N, width] uniforms: request i's at positions starts[i] + 1 .. starts[i] + width."""
    return uniform_rows([r.seed for r in reqs], starts, width, purpose)


def draw_rows(target, reqs: list[Request], starts: list[int], hidden: torch.Tensor) -> list[int]:
    """One token per request: hidden [N, H] is the row at the current token (position starts[i]); the
    token drawn decides position starts[i] + 1 (a prefill's first token: starts = prompt length - 1)."""
    probs = processed_probs(target.logits(hidden), [r.params for r in reqs])
    u = torch.from_numpy(_stream(reqs, starts, 1, FINAL)[:, 0]).to(probs.device)
    return sample_inverse_cdf(probs, u).tolist()


def sample_drafts(
    logits: torch.Tensor, reqs: list[Request], starts: list[int], spans: list[int]
) -> tuple[list[list[int]], torch.Tensor]:
    """The drafter's logits [N, B-1, V] -> (span - 1 drafts each, drawn from q; q [N, B-1, V] fp32)."""
    n, w, v = logits.shape
    params = [r.params for r in reqs for _ in range(w)]
    q = processed_probs(logits.reshape(n * w, v), params)
    u = torch.from_numpy(_stream(reqs, starts, w, DRAFT)).to(q.device).reshape(-1)
    drafts = sample_inverse_cdf(q, u).view(n, w).tolist()
    return [d[: s - 1] for d, s in zip(drafts, spans)], q.view(n, w, v)


def verify_picks(
    target,
    reqs: list[Request],
    starts: list[int],
    spans: list[int],
    hidden: list[torch.Tensor],
    drafts: list[list[int]],
    q: torch.Tensor | None,
) -> list[list[int]]:
    """Per request, its span's picks (accepted drafts, then the drawn token repeated): hidden[i] [span_i, H]
    are its verify rows; q [N, >= S-1, V] the drafts' distributions, or None for greedy drafts."""
    n, s = len(reqs), max(spans)
    flat = torch.cat(hidden)  # [sum spans, H]
    params = [r.params for r, sp in zip(reqs, spans) for _ in range(sp)]
    probs = processed_probs(target.logits(flat), params)  # [sum spans, V]
    dev = probs.device
    # [N, S] index of each (request, row) in `probs`; rows past a span point at the request's first row
    if min(spans) == s:  # every span the same (the fixed policy's steady state): a view, no copy
        p = probs.view(n, s, -1)
    else:  # [N, S] index of each (request, row) in `probs`; rows past a span repeat its last
        offsets = np.cumsum([0] + spans[:-1])
        index = [[o + min(j, sp - 1) for j in range(s)] for o, sp in zip(offsets, spans)]
        p = probs[torch.tensor(index, device=dev)]  # [N, S, V]
    padded = torch.tensor([d + [0] * (s - 1 - len(d)) for d in drafts], dtype=torch.long, device=dev)
    _, picks = accept_speculative(
        p,
        None if q is None else q[:, : s - 1],
        padded.view(n, s - 1),
        torch.tensor(spans, device=dev),
        torch.from_numpy(_stream(reqs, starts, s - 1, ACCEPT)).to(dev).view(n, s - 1),
        torch.from_numpy(_stream(reqs, starts, s, FINAL)).to(dev),
    )
    return [row[:sp] for row, sp in zip(picks.tolist(), spans)]
