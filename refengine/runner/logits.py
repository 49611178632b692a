"""Reading logits out of normed hidden states in bounded chunks (argmax, optional top-k logprobs)."""

from __future__ import annotations

import torch

from refengine.plan import TopK

__all__ = ["LOGIT_CHUNK_ROWS", "TopK", "read_logits"]

LOGIT_CHUNK_ROWS = 1024  # logits rows materialised at once: bounds the [rows, vocab] transient (the planner
# profiles exactly this chunk)


def read_logits(target, hidden: torch.Tensor, k: int) -> tuple[list[int], list[list[int]], list[list[float]]]:
    """Normed hidden [R, H] -> argmax per row, and the top-k ids / logprobs when k > 0 (empty lists
    otherwise), LOGIT_CHUNK_ROWS rows at a time. The argmax is taken in the model dtype (the fp32 cast is
    monotone, so it is exact)."""
    argmax: list[int] = []
    top_ids: list[list[int]] = []
    top_lp: list[list[float]] = []
    for lo in range(0, hidden.shape[0], LOGIT_CHUNK_ROWS):
        logits = target.logits(hidden[lo : lo + LOGIT_CHUNK_ROWS], fp32=False)  # [r, V]
        argmax += logits.argmax(-1).tolist()
        if k:
            top = logits.float().log_softmax(-1).topk(k, dim=-1)
            top_ids += top.indices.tolist()
            top_lp += top.values.tolist()
    return argmax, top_ids, top_lp
