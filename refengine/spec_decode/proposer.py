"""The seam between the engine and a draft method: the Proposer protocol.

The engine hands a proposer token spans and row counts only. Target hidden states reach it one way: every
target forward writes the tap-layer features of its rows into the feature store at their KV slots
(feature_store.py; bound with `bind_feature_store`), and the runner stages which rows a speculating request
ran (`stage_features`; a plain decode step of speculating requests, one row each, in one call:
`stage_step`). The scheduler, once it knows how many of those rows are committed, makes them drafter
context (`commit_context` after a prefill, `commit_step` after such a decode step,
`record_verify_dflash_context` after a verify; rows of prefix-cache blocks a prompt hit, which carry their
features in the store, `attach_cached` before its prefill's). Staged rows that are not committed (rejected drafts, a
failed step) are dropped; the next forward at their positions overwrites their store rows, as it does their
K/V. The DFlash lane and the test proposers (tests/proposers.py) implement it; there is no base class until
a second real draft method exists.

A proposer may also offer `launch(items) -> LaunchedDrafts | None`: the drafts queued on the device and left
there, so the runner feeds them to the verify graph without a host round trip (runner/draft_handoff.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from refengine.spec_decode.feature_store import FeatureStore


class DraftItem(NamedTuple):
    """One request's draft: the current token at absolute position `start`, and a verify span of `span`
    tokens ([current, d_1 .. d_{span-1}]), so span - 1 drafts are wanted."""

    req_id: int
    current_token: int
    start: int
    span: int


@dataclass
class LaunchedDrafts:
    """A draft graph's replay in flight (DFlashLane.launch). `tokens` is its device argmax, [bucket * width]:
    request i's drafts are rows [i*width, i*width + spans[i] - 1)."""

    tokens: torch.Tensor
    spans: list[int]
    width: int  # drafts scored a block: the graph's score cap - 1 (B - 1 at most), >= every span - 1
    # the graph's final normed rows [bucket * B, H] (request i's block: rows [i*B, i*B + B)), for the
    # logits of sampled drafts; valid until the draft graph's next replay
    hidden: torch.Tensor | None = None

    def read(self) -> list[list[int]]:
        """span - 1 drafts per request (waits for the draft graph)."""
        flat = self.tokens[: len(self.spans) * self.width].tolist()
        return [flat[i * self.width : i * self.width + s - 1] for i, s in enumerate(self.spans)]


class Proposer(Protocol):
    block_size: int  # B: the widest verify span
    capture_layers: tuple[int, ...]  # target layers whose outputs the proposer reads

    def bind_feature_store(self, store: FeatureStore) -> None:
        """The store the target's forwards write (rows of len(capture_layers) * H), before any request."""

    def start_request(self, req_id: int, capacity: int) -> None:
        """A speculating request was admitted; its context will hold at most `capacity` rows."""

    def can_start(self, capacities: list[int]) -> bool:
        """Whether requests of these capacities can start now, together (asked at admission only with a
        prefix cache: shared target blocks can admit more context than a per-request drafter pool holds)."""

    def attach_cached(self, req_id: int, rows: int) -> None:
        """The request's first `rows` positions came from prefix-cache blocks that carry tap features (in the
        store at those blocks' slots): they become its context, before its prefill's rows are committed."""

    def release(self, req_id: int) -> None:
        """The request finished (or was aborted): free everything held for it."""

    def live_requests(self) -> set[int]:
        """Requests the proposer holds state for (check_integrity compares it with the scheduler's)."""

    def context_rows(self, req_id: int) -> int:
        """Committed context rows (cached + pending): must equal the request's committed KV length."""

    def stage_features(self, req_id: int, first_position: int, rows: int) -> None:
        """The step ran positions [first_position, first_position + rows) of the request (their features are
        in the store), held until the scheduler commits some of them."""

    def commit_context(self, req_id: int, first_position: int, rows: int) -> None:
        """The first `rows` staged rows (starting at `first_position`) become context; the rest are dropped."""

    def stage_step(self, req_ids: list[int], starts: list[int]) -> None:
        """A decode step ran one row of each of req_ids, at positions starts[i]; held until commit_step."""

    def commit_step(self, req_ids: list[int]) -> None:
        """The staged decode step's rows (one per request of `req_ids`, the staged order) become context."""

    def record_verify_dflash_context(self, req_id: int, start: int, committed: int) -> None:
        """After a verify at `start` committing `committed` rows ([current, d_1..d_m]): commit those rows."""

    def discard_staged(self) -> None:
        """Drop every staged row (a step that failed before its commit)."""

    def staged_requests(self) -> set[int]:
        """Requests with staged rows not yet committed (none between steps; check_integrity looks)."""

    def propose(self, items: list[DraftItem]) -> list[list[int]]:
        """span - 1 drafts per item, in item order."""
