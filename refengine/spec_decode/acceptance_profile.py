"""Acceptance profiles: a BENCHMARK-ONLY stand-in for a real drafter's acceptance (pure Python, no torch).

With synthetic weights at real shapes (Qwen3-4B + z-lab/Qwen3-4B-DFlash-b16) the drafter accepts nothing,
so DFlash can only look slower than plain. In profile mode the drafter still runs its full forward and the
target its full verify; only m, the number of accepted drafts of each verify step (0..span-1), is drawn from
a named profile, seeded per request, and replaces accept_greedy's m in the commit: the step commits
d_1..d_m + the target's argmax at row m. Outputs are then NOT greedy-exact, which is why only
`refengine bench` can enable it (Engine(..., acceptance_override=...); EngineConfig refuses it) and every
bench row made this way says `acceptance: profile <name>`.

Profiles (`parse_profile(name)`):
  tau<T>      fixed tau: m = floor(T-1) or ceil(T-1), mixed so the mean committed tokens per step is T
              (for spans >= ceil(T)); e.g. tau1.3, tau3, tau6.5
  geom<p>     each draft accepted independently with probability p until the first rejection; e.g. geom0.8
  sharegpt    upstream's ShareGPT run: about 1.29 accepted drafts per step (9.1% of drafts accepted)
  gsm8k       z-lab Qwen3-4B-DFlash-b16 on GSM8K: tau 6.5
  humaneval   z-lab Qwen3-4B-DFlash-b16 on HumanEval: tau 6.6
The three named histograms give only published means; their shape over m = 0..15 is ASSUMED truncated
geometric with that mean at block 16 (the published figures carry no histogram).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from refengine.errors import UnsupportedConfigError

BLOCK = 16  # the histograms are defined over m = 0..BLOCK-1 (the real drafter's block size)


@dataclass(frozen=True)
class AcceptanceProfile:
    """A distribution of m (accepted drafts per step) at the full span; draw() truncates it to a span."""

    name: str
    description: str
    probs: tuple[float, ...]  # P(m = k) for k = 0..BLOCK-1 at a full span

    @property
    def mean_accepted(self) -> float:
        return sum(k * p for k, p in enumerate(self.probs))

    @property
    def tau(self) -> float:
        """Expected committed tokens per step at a full span (m + 1)."""
        return 1.0 + self.mean_accepted

    def draw(self, rng: random.Random, span: int) -> int:
        """m for one verify step of `span` rows (span - 1 drafts): a draw past span - 1 is capped there,
        as a shorter block simply cannot accept more."""
        u, acc = rng.random(), 0.0
        for k, p in enumerate(self.probs):
            acc += p
            if u < acc:
                return min(k, span - 1)
        return min(len(self.probs) - 1, span - 1)


def _truncated_geometric(p: float, n: int = BLOCK) -> tuple[float, ...]:
    """P(m=k) = p^k (1-p) for k < n-1, the rest of the mass at n-1 (every draft accepted)."""
    probs = [p**k * (1 - p) for k in range(n - 1)]
    return tuple(probs + [max(0.0, 1.0 - sum(probs))])


def _geometric_with_mean(mean: float, n: int = BLOCK) -> tuple[float, ...]:
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: the truncated mean rises with p
        mid = (lo + hi) / 2
        if sum(k * q for k, q in enumerate(_truncated_geometric(mid, n))) < mean:
            lo = mid
        else:
            hi = mid
    return _truncated_geometric((lo + hi) / 2, n)


def fixed_tau(tau: float) -> AcceptanceProfile:
    if not 1.0 <= tau <= BLOCK:
        raise UnsupportedConfigError(f"acceptance profile tau{tau}: tau must be in 1..{BLOCK}")
    m = tau - 1.0
    lo = math.floor(m)
    probs = [0.0] * BLOCK
    probs[lo] += 1.0 - (m - lo)
    if m > lo:
        probs[lo + 1] += m - lo
    return AcceptanceProfile(f"tau{tau:g}", f"fixed tau {tau:g}: m in {{{lo}, {math.ceil(m)}}}", tuple(probs))


def geometric(p: float) -> AcceptanceProfile:
    if not 0.0 <= p < 1.0:
        raise UnsupportedConfigError(f"acceptance profile geom{p}: p must be in [0, 1)")
    return AcceptanceProfile(
        f"geom{p:g}", f"per-position acceptance {p:g} until the first rejection", _truncated_geometric(p)
    )


def _published(name: str, mean_accepted: float, source: str) -> Callable[[], AcceptanceProfile]:
    def make() -> AcceptanceProfile:
        return AcceptanceProfile(
            name, f"{source}; shape assumed truncated geometric", _geometric_with_mean(mean_accepted)
        )

    return make


REGISTRY: dict[str, Callable[[], AcceptanceProfile]] = {
    "sharegpt": _published("sharegpt", 1.29, "upstream ShareGPT: ~1.29 accepted drafts/step, 9.1% acceptance"),
    "gsm8k": _published("gsm8k", 5.5, "z-lab Qwen3-4B-DFlash-b16 GSM8K: tau 6.5"),
    "humaneval": _published("humaneval", 5.6, "z-lab Qwen3-4B-DFlash-b16 HumanEval: tau 6.6"),
}


def parse_profile(name: str) -> AcceptanceProfile:
    """`tau<T>`, `geom<p>` or a registry name; anything else is an UnsupportedConfigError listing them."""
    key = name.strip().lower()
    try:
        if key.startswith("tau"):
            return fixed_tau(float(key[3:]))
        if key.startswith("geom"):
            return geometric(float(key[4:]))
    except ValueError:
        pass
    if key in REGISTRY:
        return REGISTRY[key]()
    raise UnsupportedConfigError(
        f"unknown acceptance profile {name!r}: use tau<T> (e.g. tau6.5), geom<p> "
        f"(e.g. geom0.8) or one of {sorted(REGISTRY)}"
    )


@dataclass
class AcceptanceOverride:
    """What `refengine bench` hands the engine: draws m per request per verify step, seeded per request
    (request id + seed), so the same bench command reproduces the same acceptance sequence."""

    profile: AcceptanceProfile
    seed: int = 0
    _rngs: dict[int, random.Random] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"profile {self.profile.name}"

    def draw(self, req_id: int, span: int) -> int:
        rng = self._rngs.get(req_id)
        if rng is None:
            rng = self._rngs[req_id] = random.Random(self.seed * 1_000_003 + req_id)
        return self.profile.draw(rng, span)

    def release(self, req_id: int) -> None:
        self._rngs.pop(req_id, None)
