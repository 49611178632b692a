"""Typed errors. Each message says what was wrong, with the numbers, and what to change."""
from __future__ import annotations


class RefEngineError(Exception):
    """Base of every error refengine raises on purpose."""


class CheckpointError(RefEngineError):
    """A checkpoint directory is missing a file or tensor, or a tensor has the wrong shape."""


class UnsupportedConfigError(RefEngineError):
    """A configuration refengine does not support (found at construction, never mid-run)."""


class InvalidRequestError(RefEngineError):
    """A request that can never be served: empty prompt, ids outside the vocabulary, max_tokens <= 0."""


class KvAllocationError(RefEngineError):
    """The block allocator cannot satisfy a reservation (the scheduler must never let this escape)."""


class AlignmentError(RefEngineError):
    """Drafter context, committed KV length and current-token position disagree: a crash-early invariant."""


class KvBudgetError(RefEngineError):
    """The device cannot hold a usable KV pool; the message gives the numbers and what to change."""


class IntegrityError(RefEngineError):
    """Scheduler, KV pool and drafter lane disagree about what is live: a bug, caught by check_integrity()."""
