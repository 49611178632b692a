"""The first-divergence regret gate for an output known only as text.

A server may take its speculative path only for requests without logprobs (refengine decodes a logprobs
request plainly), so the speculative output arrives as text alone. `text_regret_gate` gates it against a
reference whose token ids are known (a logprobs run, or HF's greedy): the longest reference prefix whose text
is a prefix of both texts is the shared part; at the next position the spec pick is any token of HF's top-k
whose text continues the spec text, and its regret is the least over those candidates (a lower bound on the
true pick's regret, so a FAIL is certain; none consistent: the pick is outside the top-k, regret >= top1 -
kth). Nothing after the first divergence is gated (the spec ids there are unknown).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from golden.conform.parse import TokenMap
from golden.gates import RegretReport, TopKLike, Violation


def _consistent(candidate: str, spec_text: str) -> bool:
    return spec_text.startswith(candidate) or candidate.startswith(spec_text)


def text_regret_gate(
    prompt_ids: Sequence[int],
    ref_ids: Sequence[int],
    ref_text: str,
    spec_text: str,
    score_fn: Callable[[list[int]], TopKLike],
    tmap: TokenMap,
    tol: float,
    name: str = "",
) -> RegretReport:
    """Gate `spec_text` against the reference `ref_ids` (whose text is `ref_text`), see the module docstring."""
    report = RegretReport(name=name, tol=tol, reanchor=False)
    if spec_text == ref_text:
        return report
    j = 0
    while j < len(ref_ids) and spec_text.startswith(tmap.decode(ref_ids[: j + 1])):
        j += 1
    if j == len(ref_ids):  # every reference token is in the spec text: the spec ran on
        report.length_mismatch = (len(ref_text), len(spec_text))
        return report
    report.first_divergence = j
    ids = list(prompt_ids) + list(ref_ids[:j])
    row = score_fn(ids)
    top_ids, top_lps = row.topk_ids[len(ids) - 1], row.topk_logprobs[len(ids) - 1]
    best: tuple[float, int] | None = None
    for t, lp in zip(top_ids, top_lps):
        if _consistent(tmap.decode(list(ref_ids[:j]) + [t]), spec_text):
            best = (top_lps[0] - lp, t)
            break  # rows are sorted: the first consistent candidate has the least regret
    in_topk = best is not None
    regret, pick = best if best is not None else (top_lps[0] - top_lps[-1], -1)
    report.first_regret = report.max_regret = regret
    report.gated = 1
    if regret > tol:  # outside the top-k the regret is a lower bound, as in golden/gates.py
        report.violations.append(Violation(name, j, pick, top_ids[0], regret, in_topk))
    elif pick != top_ids[0]:
        report.tie_flips = 1
    return report
