"""The reference speculative-sampling step (DFlash) and its exact enumeration.

The rule, for a block of k drafts d_0..d_{k-1}, drafted from q_j (one-hot for greedy drafts):
  accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order; at the first rejection commit one
  token sampled from norm(max(0, p_j - q_j)) and stop; when all k are accepted commit a bonus from p_k.
p_j is the target's (processed, golden.distribution.processing) distribution after the prefix plus
d_0..d_{j-1}; q_j the drafter's after the same prefix.

`exact_distribution` enumerates every draft outcome (weights q_j(d) x acceptance probability) for a
small vocabulary, extends each committed block with the target's own conditionals up to k + 1 tokens, and
`exact_check` compares that with the target's joint over k + 1 tokens: equal to float precision for the
correct rule, and clearly not for each of the `Rule` variants that model a known bug (negative controls).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from golden.errors import GoldenError

Dist = Callable[[tuple[int, ...]], np.ndarray]  # prefix (tokens after the prompt) -> distribution [V]
EXACT_TOL = 1e-12  # max |probability difference| of a lossless rule (float64 sums of <= V^(k+1) terms)
MAX_SEQUENCES = 50_000  # V^(k+1) cap of the enumeration


class SpeculativeInputError(GoldenError):
    """Speculative-step inputs that do not fit together (shapes, a draft with q_j(d_j) == 0, bad uniforms)."""


def sample_inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The token at uniform u in [0, 1) by inverse CDF over `weights` normalised (first index whose
    cumulative mass exceeds u * total)."""
    c = np.cumsum(np.asarray(weights, dtype=np.float64))
    if not c[-1] > 0:
        raise SpeculativeInputError(f"cannot sample from zero weights (sum {c[-1]})")
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(c) - 1))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); all zeros when p <= q everywhere (then rejection has probability 0)."""
    r = np.maximum(0.0, np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64))
    s = r.sum()
    return r / s if s > 0 else r


def speculative_step(
    p_rows: np.ndarray, q_rows: np.ndarray, drafts: Sequence[int], accept_u: Sequence[float], sample_u: float
) -> list[int]:
    """The committed tokens of one verify step, straight from the rule.

    p_rows [k+1, V]: target distributions at each draft position and the bonus position; q_rows [k, V]: the
    distributions the drafts were drawn from; accept_u [k]: acceptance uniforms (accept iff u < p/q);
    sample_u: the uniform of the one residual or bonus sample."""
    p, q = np.asarray(p_rows, dtype=np.float64), np.asarray(q_rows, dtype=np.float64)
    k = len(drafts)
    if p.shape[0] != k + 1 or q.shape[0] != k or p.shape[1:] != q.shape[1:] or len(accept_u) != k:
        raise SpeculativeInputError(
            f"want p [k+1, V], q [k, V], k drafts and k uniforms; got p {p.shape}, q {q.shape}, "
            f"{k} drafts, {len(accept_u)} uniforms"
        )
    if not all(0.0 <= u < 1.0 for u in [*accept_u, sample_u]):
        raise SpeculativeInputError(f"uniforms must lie in [0, 1): {list(accept_u)}, {sample_u}")
    out: list[int] = []
    for j, d in enumerate(drafts):
        if not q[j, d] > 0:
            raise SpeculativeInputError(f"draft {j} is token {d} with q = {q[j, d]}: it cannot have been drafted")
        if accept_u[j] < min(1.0, p[j, d] / q[j, d]):
            out.append(int(d))
            continue
        out.append(sample_inverse_cdf(residual(p[j], q[j]), sample_u))
        return out
    out.append(sample_inverse_cdf(p[k], sample_u))
    return out


@dataclass(frozen=True)
class Rule:
    """A speculative-sampling rule; the defaults are the correct one, each other value a known bug.

    residual: "normalized" (correct) | "unnormalized" (max(0, p - q) sampled by inverse CDF without dividing
      by its mass: u beyond the mass clamps to the last token, as a searchsorted without renormalising does)
      | "target" (rejection falls back to p). bonus: "target" (correct) | "draft" (the bonus from q_k).
    accept: "ratio" (correct) | "greedy" (accept iff d == argmax p_j, the T = 0 rule used at T > 0).
    q_rule: the drafter distribution the ratio and residual use, when it differs from the one the drafts
      were drawn from (e.g. temperature applied to the drafts but not to the q handed to accept); None =
      the same q (correct)."""

    residual: str = "normalized"
    bonus: str = "target"
    accept: str = "ratio"
    q_rule: Dist | None = None

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("residual", self.residual, ("normalized", "unnormalized", "target")),
            ("bonus", self.bonus, ("target", "draft")),
            ("accept", self.accept, ("ratio", "greedy")),
        ):
            if value not in allowed:
                raise SpeculativeInputError(f"Rule.{field} must be one of {allowed}, got {value!r}")


CORRECT = Rule()


def _reject_dist(rule: Rule, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    if rule.residual == "target":
        return p
    r = np.maximum(0.0, p - q)
    if rule.residual == "normalized":
        return r / r.sum() if r.sum() > 0 else r
    out = r.copy()  # unnormalised inverse CDF: u in [sum r, 1) falls off the end and clamps to the last token
    out[-1] += max(0.0, 1.0 - r.sum())
    return out


def exact_distribution(
    p_fn: Dist, q_fn: Dist, k: int, vocab: int, rule: Rule = CORRECT
) -> dict[tuple[int, ...], float]:
    """Exact probability of each (k+1)-token continuation: one speculative step of k drafts, its committed
    tokens extended with the target's own conditionals (what the next, lossless, steps would produce)."""
    if not 1 <= k or vocab ** (k + 1) > MAX_SEQUENCES:
        raise SpeculativeInputError(f"enumeration needs k >= 1 and V^(k+1) <= {MAX_SEQUENCES}, got V={vocab} k={k}")
    out: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], weight: float) -> None:
        if weight == 0.0:
            return
        if len(prefix) == k + 1:
            out[prefix] = out.get(prefix, 0.0) + weight
            return
        for t, pt in enumerate(p_fn(prefix)):
            extend((*prefix, t), weight * pt)

    def commit_dist(prefix: tuple[int, ...], dist: np.ndarray, weight: float) -> None:
        for t, w in enumerate(dist):
            extend((*prefix, t), weight * w)

    def step(prefix: tuple[int, ...], weight: float) -> None:
        j = len(prefix)
        p = p_fn(prefix)
        if j == k:
            commit_dist(prefix, q_fn(prefix) if rule.bonus == "draft" else p, weight)
            return
        q_draw = q_fn(prefix)
        q = q_draw if rule.q_rule is None else rule.q_rule(prefix)
        rejected = 0.0
        for d, qd in enumerate(q_draw):
            if qd == 0.0:
                continue
            if rule.accept == "greedy":
                a = 1.0 if d == int(np.argmax(p)) else 0.0
            else:
                a = min(1.0, p[d] / q[d]) if q[d] > 0 else 1.0
            step((*prefix, d), weight * qd * a)
            rejected += qd * (1.0 - a)
        if rejected > 0:
            commit_dist(prefix, _reject_dist(rule, p, q) if rule.accept == "ratio" else p, weight * rejected)

    step((), 1.0)
    return out


def target_joint(p_fn: Dist, length: int, vocab: int) -> dict[tuple[int, ...], float]:
    """The target's own probability of every `length`-token continuation."""
    out = {}
    for seq in itertools.product(range(vocab), repeat=length):
        w = 1.0
        for i in range(length):
            w *= float(p_fn(seq[:i])[seq[i]])
            if w == 0.0:
                break
        if w:
            out[seq] = w
    return out


@dataclass(frozen=True)
class ExactReport:
    passed: bool
    max_abs_error: float  # over all (k+1)-token continuations
    worst: tuple[int, ...]  # the continuation with the largest error
    got: float  # its probability under the speculative rule
    want: float  # its probability under the target
    first_token_error: float  # max |P(first committed token) - p_0| over tokens
    total_mass: float  # sum of the speculative distribution (1 for any rule that always commits)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"exact speculative-sampling check {verdict}: max |P_spec - P_target| = {self.max_abs_error:.3e} "
            f"(tol {EXACT_TOL:g}) at {self.worst}: {self.got:.6f} vs {self.want:.6f}; first token "
            f"{self.first_token_error:.3e}; mass {self.total_mass:.12f}"
        )


def exact_check(
    p_fn: Dist, q_fn: Dist, k: int, vocab: int, rule: Rule = CORRECT, tol: float = EXACT_TOL
) -> ExactReport:
    """Whether one speculative step under `rule` reproduces the target's joint over k + 1 tokens exactly."""
    got = exact_distribution(p_fn, q_fn, k, vocab, rule)
    want = target_joint(p_fn, k + 1, vocab)
    keys = set(got) | set(want)
    errs = {s: abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in keys}
    worst = max(errs, key=lambda s: errs[s])
    first = np.zeros(vocab)
    for s, w in got.items():
        first[s[0]] += w
    first_err = float(np.abs(first - p_fn(())).max())
    return ExactReport(
        passed=errs[worst] <= tol,
        max_abs_error=errs[worst],
        worst=worst,
        got=got.get(worst, 0.0),
        want=want.get(worst, 0.0),
        first_token_error=first_err,
        total_mass=float(sum(got.values())),
    )
