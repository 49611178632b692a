"""Teacher-forced scoring on the engine (Engine.score): top-k after every prefix of prompt + continuation, the
prompt as a prefill and the continuation forced into the decode steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from refengine.errors import InvalidRequestError, StepError
from refengine.models.qwen3 import Qwen3Model
from refengine.plan import TopK
from refengine.request import FinishReason, Request, SamplingParams
from refengine.validation import validate_token_ids


class ScoringEngine(Protocol):
    """What scoring uses of the Engine."""

    target: Qwen3Model

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Request: ...

    def step(self) -> list[Request]: ...

    def abort(self, request_id: int, message: str = ...) -> bool: ...


@dataclass(frozen=True)
class ScoredSequence:
    """Teacher-forced scores of prompt + continuation: topk[p] is the top-k after token_ids[:p+1]."""

    token_ids: list[int]
    topk: list[TopK]


def score_sequences(
    engine: ScoringEngine, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], k: int
) -> list[ScoredSequence]:
    """Teacher forcing: for each (prompt, continuation), the top-k after every prefix of prompt +
    continuation (one row per position, the last predicting past the sequence). The prompt runs as a
    prefill, the continuation as decode steps: before each step the request's current token (whose KV is
    not written yet) is replaced by the next continuation token. All sequences run together."""
    runs = []
    for prompt, continuation in sequences:
        cont = validate_token_ids(continuation, engine.target.cfg.vocab_size, "continuation_ids")
        params = SamplingParams(max_tokens=len(cont) + 1, logprobs=k, prompt_logprobs=True, ignore_eos=True)
        runs.append((engine.add_request(prompt, params), cont))
    for req, _ in runs:
        if req.reject_reason is not None:
            raise InvalidRequestError(f"scoring request rejected ({req.reject_reason.value}): {req.message}")
    while any(not req.finished for req, _ in runs):
        engine.step()
        failed = next((r for r, _ in runs if r.finish_reason in (FinishReason.ERROR, FinishReason.ABORTED)), None)
        if failed is not None:
            for req, _ in runs:
                engine.abort(req.request_id, f"scoring aborted: request {failed.request_id} failed")
            reason = failed.finish_reason.value if failed.finish_reason else "failed"
            raise StepError(f"scoring request {failed.request_id} {reason}: {failed.message}")
        for req, cont in runs:
            n = len(req.output_ids)
            if not req.finished and 0 < n <= len(cont):
                req.output_ids[-1] = cont[n - 1]  # force the token the next decode step feeds
    return [ScoredSequence(list(req.prompt_ids) + cont, list(req.topk)) for req, cont in runs]
