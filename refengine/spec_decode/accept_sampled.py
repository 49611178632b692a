"""Speculative sampling for DFlash as one pure function (torch, any device, no engine state): what a verify
step commits when the request samples. `accept_greedy` (accept.py) is its temperature-0 special case.

For request i with span s (drafts d_1..d_{s-1}; p_j the target's processed distribution at row j, after
[current, d_1..d_j]; q_j the distribution d_{j+1} was drawn from, one-hot for greedy drafts):
    accept d_{j+1} iff u_accept[j] < p_j(d_{j+1}) / q_j(d_{j+1}), in order;
    at the first rejection (row m) draw the token from norm(max(0, p_m - q_m)), and stop;
    when all s - 1 are accepted, draw the bonus from p_{s-1}.
The draw at row m uses u_final[m], by inverse CDF (refengine/sampling/processing.py). The committed tokens are then
distributed exactly as the target's own samples (golden/distribution/speculative.py enumerates it).

The result is written as the target's pick per verify row, the form greedy verification already has, so the
commit is the same for both: rows before m repeat the accepted drafts, row m is the drawn token, later rows
repeat it. accept_greedy on (drafts, picks) gives back m because a rejected draft has zero residual mass
(p(d) < q(d) there), so the drawn token never equals it.
"""

from __future__ import annotations

import torch

from refengine.sampling.processing import sample_inverse_cdf


def accept_speculative(
    p: torch.Tensor,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    spans: torch.Tensor,
    u_accept: torch.Tensor,
    u_final: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """p [N, S, V] target probabilities (rows past a request's span are ignored); q [N, S-1, V] the drafts'
    distributions, or None for greedy drafts (q one-hot at each draft); drafts [N, S-1] int64 (entries past a
    span ignored); spans [N] int64 in 1..S; uniforms in [0, 1): u_accept [N, S-1] (row j's test) and
    u_final [N, S] (the draw, should it happen at row j).
    Returns (accepted m [N], picks [N, S] int64)."""
    n, s, v = p.shape
    k = s - 1
    if drafts.shape != (n, k) or u_accept.shape != (n, k) or u_final.shape != (n, s) or spans.shape != (n,):
        raise ValueError(
            f"p {tuple(p.shape)}: want drafts and u_accept [{n}, {k}], spans [{n}], u_final [{n}, {s}]; got "
            f"{tuple(drafts.shape)}, {tuple(u_accept.shape)}, {tuple(spans.shape)}, {tuple(u_final.shape)}"
        )
    if q is not None and q.shape != (n, k, v):
        raise ValueError(f"q {tuple(q.shape)}: want [{n}, {k}, {v}]")
    rows = torch.arange(n, device=p.device)
    dr = drafts.clamp(0, v - 1)  # padding entries may hold anything
    in_span = torch.arange(k, device=p.device)[None, :] < (spans - 1)[:, None]  # [N, k]
    p_d = p[:, :k].gather(-1, dr[..., None]).squeeze(-1)  # [N, k]
    q_d = torch.ones_like(p_d) if q is None else q.gather(-1, dr[..., None]).squeeze(-1)
    ok = (u_accept.to(p_d.dtype) * q_d < p_d) & in_span  # u < p/q without dividing by a q that may be tiny
    m = ok.long().cumprod(-1).sum(-1)  # [N]: leading accepts
    rejected = m < spans - 1
    p_m = p[rows, m]  # [N, V]
    d_m = dr[rows, m.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(m)
    if q is None:
        q_m = torch.zeros_like(p_m).scatter_(-1, d_m[:, None], 1.0)
    else:
        q_m = q[rows, m.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_m)
    residual = (p_m - q_m).clamp(min=0)
    # at a rejection the residual has mass (p(d) < q(d) there, and both sum to 1); guard float underflow
    has_mass = residual.sum(-1, keepdim=True) > 0
    dist = torch.where(rejected[:, None] & has_mass, residual, p_m)
    final = sample_inverse_cdf(dist, u_final[rows, m])  # [N]
    cols = torch.arange(s, device=p.device)[None, :]
    padded = torch.cat([dr, torch.zeros_like(dr[:, :1])], dim=1)  # [N, S]
    picks = torch.where(cols < m[:, None], padded, final[:, None])
    return m, picks
