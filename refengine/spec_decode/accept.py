"""Greedy acceptance as pure functions (no torch): what a verify step commits, per request."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


def accept_greedy(drafts: Sequence[int], target_argmax: Sequence[int]) -> int:
    """Length m of the longest prefix with drafts[j] == target_argmax[j] (drafts d_1.. vs rows 0..).

    target_argmax[j] is the target's pick after [current, d_1..d_j]; the bonus is target_argmax[m].
    """
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"verify rows {len(target_argmax)} != drafts {len(drafts)} + 1")
    m = 0
    while m < len(drafts) and drafts[m] == target_argmax[m]:
        m += 1
    return m


@dataclass(frozen=True)
class VerifyResult:
    accepted: int  # m: drafts accepted
    new_tokens: tuple[int, ...]  # tokens to append: d_1..d_m + bonus, truncated after an EOS
    hit_eos: bool

    @property
    def committed(self) -> int:
        """Rows of the verify span whose KV (and target features) become committed: [current, d_1..]."""
        return len(self.new_tokens)


def build_verify_results(
    drafts: Sequence[Sequence[int]],
    target_argmax: Sequence[Sequence[int]],
    eos_ids: Collection[int],
    ignore_eos: Sequence[bool],
    accepted: Sequence[int] | None = None,
) -> list[VerifyResult]:
    """One VerifyResult per request. EOS inside the committed run truncates right after it.

    `accepted` (benchmark acceptance profiles only, refengine.spec_decode.acceptance_profile) replaces
    accept_greedy's m per request: the run is then d_1..d_m + target_argmax[m], no longer greedy-exact."""
    out = []
    for i, (d, t, ign) in enumerate(zip(drafts, target_argmax, ignore_eos, strict=True)):
        m = accept_greedy(d, t)
        if accepted is not None:
            if not 0 <= accepted[i] <= len(d):
                raise ValueError(f"forced acceptance {accepted[i]} outside 0..{len(d)} drafts")
            m = accepted[i]
        run = list(d[:m]) + [t[m]]
        hit = False
        if not ign:
            for j, tok in enumerate(run):
                if tok in eos_ids:
                    run, hit = run[: j + 1], True
                    break
        out.append(VerifyResult(accepted=m, new_tokens=tuple(run), hit_eos=hit))
    return out
