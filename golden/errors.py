"""Typed errors of the golden suite. Each message says what was wrong, with names and numbers.

All subclass ValueError, so a caller that only knows "bad input" can catch that; the gate CLI maps every
GoldenError to exit code 2 (input that cannot be gated), never to a pass.
"""

from __future__ import annotations


class GoldenError(ValueError):
    """Base of every error golden raises on purpose."""


class CoverageError(GoldenError):
    """Engine records do not cover the golden records they are gated against: none at all, some missing,
    a name twice, a name the golden does not know, different input ids for the same name, or top-k rows too
    narrow for the head deltas (k < 8)."""


class RecordError(GoldenError):
    """A record file or record that cannot be read: malformed JSON, missing keys, the wrong kind of record."""
