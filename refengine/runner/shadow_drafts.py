"""A shadow probe's drafts (spec_decode/shadow_probe.py), run beside the decode step that carries them.

On CUDA the drafts go on a second stream once the decode graph is queued, so the draft graph (and a
prompt's catch-up before it) overlaps the decode on the device, and its host work (layout, attention plan,
launch) overlaps the decode too: the host would only wait for it. Two graphs can replay at once because with
shadow probes on the drafter's graphs have their own memory pool and FlashInfer float workspace (engine.py,
graph_setup.py).
The drafts come back through pinned memory after the decode's results. Once the draft is queued the main
stream waits for the side one (the decode graph is already ahead of that wait), so everything queued after
it, the next step's work on the lane's buffers included, runs behind the draft. Elsewhere (the CPU, a
replaced `propose`, no draft graph fitting) the proposer drafts after the decode, one after the other.

Catch-up and draft times measured beside a decode are not a draft's own: they are dropped, not learnt.
"""

from __future__ import annotations

import torch

from refengine.runner.draft_handoff import launch_drafts
from refengine.spec_decode.proposer import DraftItem, LaunchedDrafts, Proposer


class ShadowDrafts:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: tuple[torch.Tensor, torch.cuda.Event, LaunchedDrafts] | None = None

    def begin(self) -> None:
        """Before the decode step is queued: the side stream starts after what the main stream holds now
        (the previous steps' writes), not after the decode. Nothing of an earlier step that failed between
        its launch and its read is left to be read as this step's, nor running still."""
        if self._pending is not None and self.stream is not None:
            self.stream.synchronize()
        self._pending = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())

    def launch(self, proposer: Proposer, items: list[DraftItem]) -> None:
        """Once the decode graph is queued: the drafts of `items` on the side stream (when a draft graph fits;
        else `read` drafts them eagerly)."""
        self._pending = None
        if self.stream is None:
            return
        with torch.cuda.stream(self.stream):
            # the full block's score cap: a narrower one's graph, captured on first use, would be captured here,
            # beside the decode's replay, which invalidates the capture (H200 run 120: every later step failed)
            launched = launch_drafts(proposer, items, full_block=True)
            if launched is None:
                return
            n = len(items) * launched.width
            host = torch.empty(n, dtype=launched.tokens.dtype, pin_memory=True)
            host.copy_(launched.tokens[:n], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        # what the main stream queues from here (the decode's result copy, the next step) waits for the draft:
        # the lane's buffers are never rewritten under it, even if this step fails before `read`
        torch.cuda.current_stream().wait_stream(self.stream)
        self._pending = (host, done, launched)

    def read(self, proposer: Proposer, items: list[DraftItem]) -> list[list[int]]:
        """span - 1 drafts per item (after the decode's own results were read)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            host, done, launched = pending
            done.synchronize()
            torch.cuda.current_stream().wait_stream(self.stream)  # type: ignore[arg-type]
            drafts = LaunchedDrafts(host, launched.spans, launched.width).read()
        else:
            drafts = proposer.propose(items)
        for drop in ("take_catch_up", "take_sync_wait"):  # beside a decode: not the draft's own cost
            getattr(proposer, drop, lambda: 0.0)()
        return drafts
