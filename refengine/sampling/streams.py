"""Per-request random streams for sampling, counter-based: every uniform is a hash of (the request's seed, the
absolute position of the token it decides, its purpose), so what a request draws depends on nothing else.
Its tokens are then the same alone or in any batch, in any graph mode, and after a step of other requests
(or its own) fails and is rolled back: the retry redraws exactly the same uniforms. A token position is
decided once per committed step, so no uniform is ever used twice.

Purposes: DRAFT (the drafter's sample of the draft at that position), ACCEPT (the accept test of that
draft), FINAL (the target's own draw there: plain decode, the prefill's first token, the residual after a
rejection, or the bonus after a full accept). A span-1 verify and a plain decode step draw the same FINAL.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DRAFT, ACCEPT, FINAL = 1, 2, 3

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_POSITION, _PURPOSE = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 with full avalanche."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _hash(seeds: np.ndarray, positions: np.ndarray, purpose: int) -> np.ndarray:
    """seeds [N, 1], positions [N, W] (uint64) -> float64 uniforms [N, W] in [0, 1)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        keys = _mix(seeds ^ (np.uint64(purpose) * _PURPOSE))
        x = _mix(keys ^ (positions * _POSITION))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def uniforms(seed: int, positions: Sequence[int], purpose: int) -> np.ndarray:
    """float64 uniforms in [0, 1), one per position, for `purpose` of the request seeded `seed`."""
    return _hash(np.array([[seed]], dtype=np.uint64), np.asarray(positions, dtype=np.uint64)[None, :], purpose)[0]


def uniform_rows(seeds: Sequence[int], starts: Sequence[int], width: int, purpose: int) -> np.ndarray:
    """[N, width] uniforms, request i's (seeded seeds[i]) at positions starts[i] + 1 .. starts[i] + width: a
    step's draws for every request in one vectorised pass."""
    pos = np.asarray(starts, dtype=np.uint64)[:, None] + np.arange(1, width + 1, dtype=np.uint64)[None, :]
    return _hash(np.asarray(seeds, dtype=np.uint64)[:, None], pos, purpose)
