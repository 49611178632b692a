"""The draft-to-verify hand-off on the device.

A verify step's drafts go from the draft graph's argmax buffer straight into the verify graph's token ids
(`draft_fill`), and the host reads them back once, with the verify's own results. Without it the host waited
for the draft, then laid out, planned and launched the verify while the GPU stood idle; with it that host
work overlaps the draft on the GPU, and so does the catch-up of a request's prompt before its first draft.

A proposer whose `propose` was replaced on the instance (the test suite's draft logs, injected faults and
deliberately broken drafts) goes the host way, so that the replacement sees, and may change, every draft the
verify runs. So does a step no draft graph fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import accumulate

import torch

from refengine.models.segmented import StepState
from refengine.spec_decode.proposer import DraftItem, LaunchedDrafts, Proposer


def launch_drafts(proposer: Proposer, items: list[DraftItem]) -> LaunchedDrafts | None:
    """The drafts of `items` queued on the device, or None: the proposer has no `launch`, its `propose` was
    replaced, or no draft graph fits (nothing ran; call propose)."""
    launch = getattr(proposer, "launch", None)
    if launch is None or "propose" in vars(proposer):
        return None
    return launch(items)


def draft_fill(launched: LaunchedDrafts, drafting: list[int], spans: list[int]) -> Callable[[StepState], None]:
    """The verify graph's fill (StepGraph.replay): request k's rows start at the sum of the spans before it
    and hold [current, d_1 .. d_{span-1}]; request drafting[j]'s drafts are the launched rows of item j."""
    offsets = list(accumulate(spans, initial=0))
    w = launched.width
    dst: list[int] = []  # verify rows
    src: list[int] = []  # launched draft rows
    for j, k in enumerate(drafting):
        dst += range(offsets[k] + 1, offsets[k] + spans[k])
        src += range(j * w, j * w + spans[k] - 1)
    dev = launched.tokens.device
    index = torch.tensor([dst, src], pin_memory=dev.type == "cuda").to(dev, non_blocking=True)  # [2, D]

    def fill(st: StepState) -> None:
        st.ids.index_copy_(0, index[0], launched.tokens.index_select(0, index[1]))

    return fill


class VerifyClock:
    """A verify step's wall time, split into draft and verify (the runner's timings; the adaptive policy fits
    its cost curves on them). The host no longer waits for the draft, so on CUDA the draft's end is an event:
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
