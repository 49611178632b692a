"""Typed errors. Each message says what was wrong, with the numbers, and what to change."""

from __future__ import annotations


class RefEngineError(Exception):
    """Base of every error refengine raises on purpose."""


class CheckpointError(RefEngineError):
    """A checkpoint that cannot be loaded as written: a missing or unreadable file (empty, truncated, not
    JSON / safetensors), a config field of the wrong JSON type or range, a missing, misshaped, non-float or
    non-finite tensor. The message names the checkpoint, the file and the field or tensor."""


class UnsupportedConfigError(RefEngineError):
    """A configuration refengine does not support (found at construction, never mid-run)."""


class InvalidRequestError(RefEngineError):
    """A request that can never be served: a value of the wrong type (named with its field, index and type),
    an empty prompt, ids outside the vocabulary, max_tokens <= 0, prompt text that is not UTF-8."""


class KvAllocationError(RefEngineError):
    """The block allocator cannot satisfy a reservation (the scheduler must never let this escape)."""


class AlignmentError(RefEngineError):
    """Drafter context, committed KV length and current-token position disagree: a crash-early invariant."""


class KvBudgetError(RefEngineError):
    """The device cannot hold a usable KV pool; the message gives the numbers and what to change."""


class IntegrityError(RefEngineError):
    """Scheduler, KV pool and drafter lane disagree about what is live: a bug, caught by check_integrity()."""


class StepError(RefEngineError):
    """An engine step failed (an exception from the forward or the proposer, or a malformed result); the
    step was rolled back, and a request whose second step failed finished with FinishReason.ERROR."""


class TensorParallelError(RefEngineError):
    """A tensor-parallel rank died or a collective failed or timed out (EngineConfig.tensor_parallel_timeout_s).
    The engine cannot serve any more: Engine.step raises it (after rolling the step back) and so does every
    later step; close the engine (Engine.close()) and start a new one."""
