"""Test proposers behind the same propose seam as the DFlash lane: they force acceptance patterns so the
transaction (reserve, verify, accept, commit, roll back, context alignment) is exercised exactly.

- oracle: replays the plain greedy continuation, so every verify step must commit exactly its span;
- garbage: every first draft is wrong, so every step commits exactly one token (tau == 1);
- noisy: a given function decides, per draft, whether it is replaced by a wrong token.
They keep the same bookkeeping as the lane (context rows per request, alignment asserts; the engine writes
real target features into their feature store), but draft from the reference output instead of a model.
"""

from __future__ import annotations

from collections.abc import Callable

from refengine.errors import AlignmentError
from refengine.spec_decode import DraftItem


class ReplayProposer:
    def __init__(self, block_size: int, vocab_size: int, corrupt: Callable[[int, int, int], bool] | None = None):
        self.block_size = block_size
        self.capture_layers = (0,)  # real features flow through the seam; only their row count matters here
        self.vocab_size = vocab_size
        self.corrupt = corrupt or (lambda req_id, step, j: False)
        self._rows: dict[int, int] = {}
        self._expect: dict[int, tuple[int, list[int]]] = {}
        self._steps: dict[int, int] = {}
        self._staged: dict[int, tuple[int, int]] = {}  # req -> (first position, rows) staged this step

    def expect(self, req_id: int, prompt_len: int, reference_output: list[int]) -> None:
        self._expect[req_id] = (prompt_len, reference_output)

    # ---- the Proposer protocol (refengine.spec_decode.proposer) --------------------------------------------
    def start_request(self, req_id: int, capacity: int) -> None:
        self._rows[req_id] = 0
        self._steps[req_id] = 0

    def can_start(self, capacities: list[int]) -> bool:
        return True  # no pool

    def attach_cached(self, req_id: int, rows: int) -> None:
        if self._rows[req_id] != 0:
            raise AlignmentError(f"request {req_id}: cached rows attached after {self._rows[req_id]} context rows")
        self._rows[req_id] = rows

    def release(self, req_id: int) -> None:
        self._rows.pop(req_id, None)
        self._staged.pop(req_id, None)

    def live_requests(self) -> set[int]:
        return set(self._rows)

    def context_rows(self, req_id: int) -> int:
        return self._rows[req_id]

    def bind_feature_store(self, store) -> None:
        self.store = store  # the engine's forwards write real tap features there; only row counts matter here

    def stage_features(self, req_id: int, first_position: int, rows: int) -> None:
        self._staged[req_id] = (first_position, rows)

    def commit_context(self, req_id: int, first_position: int, rows: int) -> None:
        start, staged = self._staged.pop(req_id)
        if first_position != self._rows[req_id] or start != first_position or rows > staged:
            raise AlignmentError(
                f"request {req_id}: rows [{first_position}, +{rows}) against staged "
                f"[{start}, +{staged}), context ends at {self._rows[req_id]}"
            )
        self._rows[req_id] += rows

    def stage_step(self, req_ids: list[int], starts: list[int]) -> None:
        for req_id, start in zip(req_ids, starts):
            self._staged[req_id] = (start, 1)

    def commit_step(self, req_ids: list[int]) -> None:
        for req_id in req_ids:
            self.commit_context(req_id, self._staged[req_id][0], 1)

    def record_verify_dflash_context(self, req_id: int, start: int, committed: int) -> None:
        self.commit_context(req_id, start, committed)

    def discard_staged(self) -> None:
        self._staged.clear()

    def staged_requests(self) -> set[int]:
        return set(self._staged)

    def propose(self, items: list[DraftItem]) -> list[list[int]]:
        out = []
        for req_id, current, start, span in items:
            if self._rows[req_id] != start:
                raise AlignmentError(f"request {req_id}: {self._rows[req_id]} context rows, current at {start}")
            prompt_len, ref = self._expect[req_id]
            i = start - prompt_len  # index of the current token in the output
            assert ref[i] == current, f"request {req_id} left the reference at output {i}"
            step = self._steps[req_id]
            self._steps[req_id] += 1
            drafts = []
            for j in range(1, span):
                tok = ref[i + j] if i + j < len(ref) else 0
                if self.corrupt(req_id, step, j):
                    tok = (tok + 1) % self.vocab_size
                drafts.append(tok)
            out.append(drafts)
        return out


def oracle(block_size: int, vocab_size: int) -> ReplayProposer:
    return ReplayProposer(block_size, vocab_size)


def oracle_runs(max_tokens: int, block_size: int) -> list[int]:
    """What an oracle's verify steps commit under fixed spans, sorted: the first token comes from the
    prefill, then each step commits min(B, remaining) tokens exactly."""
    runs, left = [], max_tokens - 1
    while left > 0:
        runs.append(min(block_size, left))
        left -= runs[-1]
    return sorted(runs)


def garbage(block_size: int, vocab_size: int) -> ReplayProposer:
    return ReplayProposer(block_size, vocab_size, corrupt=lambda req_id, step, j: j == 1)
