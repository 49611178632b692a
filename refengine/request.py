"""Request, its sampling parameters, status and the per-request speculative statistics."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from refengine.errors import InvalidRequestError
from refengine.validation import as_bool, as_int, as_real

MAX_LOGPROBS = 64  # most top tokens a request may ask for per position
MAX_TEMPERATURE = 100.0  # beyond it the distribution is uniform to float precision (and inf/nan are refused)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    REJECTED = "rejected"  # never admitted (see RejectReason and the message)
    ABORTED = "aborted"  # Engine.abort: the caller gave up on it
    ERROR = "error"  # the steps it was part of failed (the message names the exception)


class RejectReason(enum.Enum):
    INVALID = "invalid"
    CONTEXT_LENGTH = "context_length"
    KV_BUDGET = "kv_budget"


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens. temperature 0 is greedy (top_k / top_p are then unused); above 0 the
    target's logits are processed as HF `generate` does (temperature, then top-k, then top-p:
    refengine/sampling/processing.py) and sampled, with DFlash speculative sampling when the request drafts.
    `seed` keys the request's random stream (refengine/sampling/streams.py): the same seed gives the same
    tokens alone or in any batch; None draws one at admission. `logprobs` > 0 returns that many top tokens per
    position, of the unprocessed distribution (and makes the request ineligible for speculation, as upstream).

    Validated at construction (refengine.validation): integers may be Python ints, numpy integer scalars or
    0-d torch integer tensors and are stored as int; bools, floats, strings and None are an
    InvalidRequestError naming the field and the value, as are out-of-range values."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    logprobs: int = 0
    prompt_logprobs: bool = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def put(name: str, value) -> None:
            object.__setattr__(self, name, value)  # frozen: normalise in place once

        put("max_tokens", as_int(self.max_tokens, "max_tokens"))
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens} must be >= 1")
        put("temperature", as_real(self.temperature, "temperature"))
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(f"temperature={self.temperature}: must be in [0, {MAX_TEMPERATURE}]")
        put("top_k", as_int(self.top_k, "top_k"))
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k={self.top_k}: must be >= 0 (0 = off)")
        put("top_p", as_real(self.top_p, "top_p"))
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p={self.top_p}: must be in (0, 1] (1 = off)")
        if self.seed is not None:
            put("seed", as_int(self.seed, "seed"))
            if not 0 <= self.seed < 2**63:
                raise InvalidRequestError(f"seed={self.seed}: must be in 0..2**63 - 1")
        put("logprobs", as_int(self.logprobs, "logprobs"))
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs={self.logprobs}: must be in 0..{MAX_LOGPROBS}")
        put("prompt_logprobs", as_bool(self.prompt_logprobs, "prompt_logprobs"))
        put("ignore_eos", as_bool(self.ignore_eos, "ignore_eos"))
        if self.prompt_logprobs and self.logprobs == 0:
            raise InvalidRequestError("prompt_logprobs needs logprobs > 0 (how many top tokens to return)")

    @property
    def sampled(self) -> bool:
        """Whether tokens are drawn (temperature > 0) rather than the argmax."""
        return self.temperature > 0.0


@dataclass
class SpecStats:
    """Acceptance statistics: tau = committed tokens per verify step (a drafting request's span-1 steps count as
    verify steps of one token)."""

    verify_steps: int = 0
    committed_tokens: int = 0
    accepted_hist: Counter = field(default_factory=Counter)  # committed length (m+1) -> steps
    committed_per_step: list[int] = field(default_factory=list)  # per request: tokens committed by each verify
    span_hist: Counter = field(default_factory=Counter)  # verify span chosen (1..B) -> steps
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.committed_tokens / self.verify_steps if self.verify_steps else 0.0

    def record(self, committed: int, span: int | None = None, times: int = 1) -> None:
        """`times` steps that each committed `committed` tokens (verify span `span`)."""
        self.verify_steps += times
        self.committed_tokens += committed * times
        self.accepted_hist[committed] += times
        if times == 1:
            self.committed_per_step.append(committed)
        else:
            self.committed_per_step += [committed] * times
        if span is not None:
            self.span_hist[span] += times

    def merge(self, other: SpecStats) -> None:
        self.verify_steps += other.verify_steps
        self.committed_tokens += other.committed_tokens
        self.accepted_hist.update(other.accepted_hist)
        self.span_hist.update(other.span_hist)
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    reject_reason: RejectReason | None = None
    message: str = ""
    # Top-k per scored position: (ids, logprobs); prompt positions first when prompt_logprobs.
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)
    spec: SpecStats = field(default_factory=SpecStats)
    failed_steps: int = 0  # steps this request was part of that failed and were rolled back
    seed: int = 0  # its random stream's key: params.seed, or drawn at admission (Engine.add_request)
    cached_tokens: int = 0  # prompt tokens it took from the prefix cache at admission (not prefilled)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def committed_len(self) -> int:
        """Tokens whose KV is committed: all but the current (last generated) token."""
        return self.num_tokens - 1

    def finish(self, reason: FinishReason, message: str = "") -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.message = message

    def reject(self, reason: RejectReason, message: str) -> None:
        self.reject_reason = reason
        self.finish(FinishReason.REJECTED, message)
