"""The draft-to-verify hand-off on the device.

A verify step's drafts go from the draft graph's argmax buffer straight into the verify graph's token ids
(`placeholders` in the host's layout, swapped on the device by `draft_fill`), and the host reads them back
once, with the verify's own results. Without it the host waited for the draft, then laid out, planned and
launched the verify while the GPU stood idle; with it that host work overlaps the draft on the GPU, and so
does the catch-up of a request's prompt before its first draft.

A proposer whose `propose` was replaced on the instance (the test suite's draft logs, injected faults and
deliberately broken drafts) goes the host way, so that the replacement sees, and may change, every draft the
verify runs. So does a step no draft graph fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from refengine.models.segmented import StepState
from refengine.spec_decode.proposer import DraftItem, LaunchedDrafts, Proposer


def launch_drafts(proposer: Proposer, items: list[DraftItem], full_block: bool = False) -> LaunchedDrafts | None:
    """The drafts of `items` queued on the device, or None: the proposer has no `launch`, its `propose` was
    replaced, or no draft graph fits (nothing ran; call propose). `full_block`: the draft graph scoring the
    whole block, whatever the spans (not a narrower score cap's)."""
    launch = getattr(proposer, "launch", None)
    if launch is None or "propose" in vars(proposer):
        return None
    return launch(items, full_block=True) if full_block else launch(items)


def placeholders(launched: LaunchedDrafts, item: int) -> list[int]:
    """Item `item`'s drafts in a verify step's token ids before the fill: -1 - (their row in launched.tokens).
    They travel with the rows through the graph's packing (and upstream's truncation, capture-shape rule
    off), so the fill finds them wherever the layout put them."""
    w = launched.width
    return [-1 - (item * w + m) for m in range(launched.spans[item] - 1)]


def draft_fill(launched: LaunchedDrafts) -> Callable[[StepState], None]:
    """The verify graph's fill (StepGraph.replay): every placeholder id becomes the draft it names."""

    def fill(st: StepState) -> None:
        ids = st.ids
        drafts = launched.tokens.index_select(0, (-1 - ids).clamp(min=0))  # real ids read row 0: discarded
        ids.copy_(torch.where(ids < 0, drafts, ids))

    return fill


class VerifyClock:
    """A verify step's wall time, split into draft and verify (the runner's timings, and the span policy's
    cost samples). The host no longer waits for the draft, so on CUDA the draft's end is an event:
    draft = from the step's start to the draft graph's end, verify = the rest of the step. On the CPU every
    op is done when it returns, and the host clock splits it."""

    def __init__(self, device: torch.device):
        self.t0 = time.perf_counter()
        self._t1 = self.t0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def drafted(self) -> None:
        """Mark the end of the draft (queued after it on CUDA)."""
        self._t1 = time.perf_counter()
        if self._events is not None:
            self._events[1].record()

    def split(self) -> tuple[float, float]:
        """(draft_s, verify_s) from the start to now; call once the verify's results are read."""
        total = time.perf_counter() - self.t0
        draft = self._t1 - self.t0
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            draft = start.elapsed_time(end) / 1e3
        draft = min(max(draft, 0.0), total)
        return draft, total - draft
