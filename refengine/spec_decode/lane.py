"""The DFlash lane: each request's drafter context (cached context K/V per drafter layer, pending target
features) and the batched propose. Hidden states never leave this file: the engine sees token spans only.

Invariant after every commit (checked before every draft): drafter context rows == committed target KV
length == position of the current token. Violations raise AlignmentError at once (no silent clamping).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refengine.config import DRAFT_CONTEXT_FLUSH_ROWS
from refengine.errors import AlignmentError
from refengine.models.dflash import DFlashDrafter
from refengine.spec_decode.proposer import DraftItem

FLUSH_ROWS = DRAFT_CONTEXT_FLUSH_ROWS  # context rows projected per chunk (bounds the flush transient)


@dataclass
class DraftContext:
    capacity: int                  # context rows it can hold (prompt + max_tokens)
    k: list[torch.Tensor]          # per drafter layer: [capacity + B, nkv, d]; the B tail rows are block scratch
    v: list[torch.Tensor]
    length: int = 0                # context rows whose K/V are cached
    pending: list[torch.Tensor] = field(default_factory=list)  # target features [rows, F*H], not yet projected
    pending_rows: int = 0


class DFlashLane:
    """The DFlash Proposer (refengine.spec_decode.proposer)."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.block_size = drafter.cfg.block_size
        self.capture_layers = drafter.cfg.target_layer_ids
        self._ctx: dict[int, DraftContext] = {}
        self._staged: dict[int, tuple[int, torch.Tensor]] = {}  # req -> (first position, features) of one step

    def start_request(self, req_id: int, capacity: int) -> None:
        m, d = self.drafter.mcfg, self.drafter.fc
        shape = (capacity + self.block_size, m.num_kv_heads, m.head_dim)
        self._ctx[req_id] = DraftContext(
            capacity=capacity,
            k=[torch.empty(shape, dtype=d.dtype, device=d.device) for _ in range(m.num_layers)],
            v=[torch.empty(shape, dtype=d.dtype, device=d.device) for _ in range(m.num_layers)])

    def release(self, req_id: int) -> None:
        self._ctx.pop(req_id, None)
        self._staged.pop(req_id, None)

    def live_requests(self) -> set[int]:
        return set(self._ctx)

    def context_rows(self, req_id: int) -> int:
        c = self._ctx[req_id]
        return c.length + c.pending_rows

    def persistent_bytes(self) -> int:
        """Bytes held for live requests: context K/V buffers plus pending target features."""
        total = 0
        for c in self._ctx.values():
            total += sum(t.numel() * t.element_size() for t in c.k + c.v)
            total += sum(f.numel() * f.element_size() for f in c.pending)
        return total

    # ---- features: staged by the runner, committed by the scheduler ---------------------------------------
    def stage_features(self, req_id: int, first_position: int, feats: torch.Tensor) -> None:
        if req_id not in self._ctx:
            raise AlignmentError(f"request {req_id}: features staged for a request with no drafter context")
        self._staged[req_id] = (first_position, feats)

    def commit_context(self, req_id: int, first_position: int, rows: int) -> None:
        staged = self._staged.pop(req_id, None)
        if staged is None:
            raise AlignmentError(f"request {req_id}: {rows} context rows committed but no features were staged")
        start, feats = staged
        if start != first_position or not 0 < rows <= feats.shape[0]:
            raise AlignmentError(f"request {req_id}: commit of rows [{first_position}, {first_position + rows}) "
                                 f"but the staged features cover [{start}, {start + feats.shape[0]})")
        self.append_pending_context(req_id, feats[:rows], first_position)

    def record_verify_dflash_context(self, req_id: int, start: int, committed: int) -> None:
        """After a verify at `start` committing `committed` rows ([current, d_1..d_m]), those rows' target
        features become context. The new current token (the bonus) has no features yet."""
        self.commit_context(req_id, start, committed)

    def discard_staged(self) -> None:
        self._staged.clear()

    def staged_requests(self) -> set[int]:
        return set(self._staged)

    def append_pending_context(self, req_id: int, feats: torch.Tensor, first_position: int) -> None:
        """Queue target features for positions [first_position, first_position + rows)."""
        c = self._ctx.get(req_id)
        if c is None:
            raise AlignmentError(f"request {req_id}: no drafter context (start_request was not called)")
        if feats.dim() != 2 or feats.shape[1] != self.drafter.feature_width:
            raise AlignmentError(f"request {req_id}: feature shape {list(feats.shape)}, "
                                 f"expected [rows, {self.drafter.feature_width}]")
        if first_position != c.length + c.pending_rows:
            raise AlignmentError(f"request {req_id}: features start at position {first_position}, "
                                 f"but the drafter context ends at {c.length + c.pending_rows}")
        if first_position + feats.shape[0] > c.capacity:
            raise AlignmentError(f"request {req_id}: context overflow, {first_position + feats.shape[0]} rows "
                                 f"> capacity {c.capacity}")
        c.pending.append(feats)
        c.pending_rows += feats.shape[0]

    def _flush_pending(self, req_ids: list[int]) -> None:
        """Project pending rows (dense ops over many rows at once), then scatter into each context buffer.

        Rows go in chunks of at most FLUSH_ROWS so the transient (fc output, fp32 norm, per-layer K/V) stays
        bounded when many long prompts were prefilled before the first draft."""
        chunk: list[tuple[DraftContext, int, torch.Tensor]] = []  # (context, first position, rows)
        rows = 0
        for c in (self._ctx[r] for r in req_ids):
            pos = c.length
            for f in c.pending:
                for lo in range(0, f.shape[0], FLUSH_ROWS):
                    part = f[lo:lo + FLUSH_ROWS]
                    if rows + part.shape[0] > FLUSH_ROWS:
                        self._project(chunk)
                        chunk, rows = [], 0
                    chunk.append((c, pos, part))
                    pos += part.shape[0]
                    rows += part.shape[0]
            c.pending, c.pending_rows = [], 0
        if chunk:
            self._project(chunk)

    def _project(self, chunk: list[tuple[DraftContext, int, torch.Tensor]]) -> None:
        feats = torch.cat([f for _, _, f in chunk])  # [R, F*H]
        positions = torch.cat([torch.arange(p, p + f.shape[0]) for _, p, f in chunk]).to(feats.device)
        kv = self.drafter.context_kv(feats, positions)
        row = 0
        for c, p, f in chunk:
            n = f.shape[0]
            for li, (k, v) in enumerate(kv):
                c.k[li][p:p + n] = k[row:row + n]
                c.v[li][p:p + n] = v[row:row + n]
            c.length = p + n
            row += n

    @torch.inference_mode()
    def propose(self, items: list[DraftItem]) -> list[list[int]]:
        """items: (req_id, current_token, start, span) -> span - 1 drafts each (the block is always B wide;
        a truncated span just uses fewer of its rows)."""
        drafts = self.propose_logits(items, fp32=False).argmax(-1).tolist()  # [N, B-1]
        return [d[:span - 1] for d, (_, _, _, span) in zip(drafts, items)]

    @torch.inference_mode()
    def propose_logits(self, items: list[DraftItem], fp32: bool = True) -> torch.Tensor:
        """The drafter's logits [N, B-1, V] for rows 1..B-1 of each request's block."""
        req_ids = [r for r, *_ in items]
        self._flush_pending(req_ids)
        b, dev = self.block_size, self.drafter.fc.device
        for r, _tok, start, span in items:
            if self._ctx[r].length != start:
                raise AlignmentError(f"request {r}: drafter context has {self._ctx[r].length} rows, "
                                     f"current token is at position {start}")
            if not 1 <= span <= b:
                raise AlignmentError(f"request {r}: span {span} outside 1..{b}")
        tokens = torch.tensor([[tok] + [self.drafter.cfg.mask_token_id] * (b - 1) for _, tok, _, _ in items],
                              device=dev).view(-1)
        positions = torch.cat([torch.arange(s, s + b) for _, _, s, _ in items]).to(dev)
        ctxs = [self._ctx[r] for r in req_ids]
        return self.drafter.draft_logits(tokens, positions, [list(zip(c.k, c.v)) for c in ctxs],
                                         [c.length for c in ctxs], fp32=fp32)
