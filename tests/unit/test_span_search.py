"""The span search's array pass (refengine/spec_decode/span_choice.py: _search, and what feeds it) against the
plain enumeration it replaced, the specification kept here: for each cap S = 2..min(B, longest budget), every
request at min(S, its budget), then its k = 0..n-1 smallest-gain requests (ties: lower index first) switched
to span 1; the first candidate of the highest predicted rate wins if it beats plain by SPEC_MARGIN. Checks that
on random tables, budgets, cost models, graph-row maps and catch-up costs:
- the chosen spans and predicted rate equal the enumeration's, except on exact ties of rate (where the
  enumeration's running comparison could take a later candidate on a rounding difference of its running sums);
  with draft costs by score cap (a draft whose largest span is S priced at its graph's score cap: cap S's
  candidates pay that draft);
- CostModel.draft_costs equals draft_s at every count, measured buckets and fitted ones alike, at every span;
- AcceptanceEstimates.tables gives the same floats from its array pass (_tables_array) as per request.

Run: python -m pytest tests/unit/test_span_search.py -q
"""

from __future__ import annotations

import random

from refengine.spec_decode import acceptance_estimate
from refengine.spec_decode.acceptance_estimate import AcceptanceEstimates, geometric_table
from refengine.spec_decode.span_choice import SPEC_MARGIN, choose_spans, real_rows
from refengine.spec_decode.step_costs import CostModel


def _enumerated(tables, remaining, block, cost, rows, switch_s):
    """The reference: (rate, spans, cap) of the best candidate, or None when plain wins."""
    n = len(tables)
    best = (n / cost.plain_s(n) * SPEC_MARGIN, None, 1)
    for cap in range(2, min(block, max(remaining)) + 1):
        spans = [cap if r >= cap else max(1, r) for r in remaining]
        gains = [e[s] - 1.0 for e, s in zip(tables, spans)]
        order = sorted(range(n), key=gains.__getitem__)
        for k in range(n):
            cand = list(spans)
            for i in order[:k]:
                cand[i] = 1
            drafted = sum(1 for s in cand if s > 1)
            if not drafted:
                break
            denom = cost.draft_s(drafted, cap) + switch_s + cost.verify_s(n, rows(n, sum(cand)))
            rate = (n + sum(e[s] - 1.0 for e, s in zip(tables, cand))) / denom
            if rate > best[0]:
                best = (rate, cand, cap)
    return None if best[1] is None else best


def _score_cap(block: int):
    """The runner's draft_score_cap for caps 4, 8, ..., block: None for the full block's."""

    def cap(widest: int) -> int | None:
        c = next(c for c in (4, 8, block) if c >= min(widest, block))
        return None if c == block else c

    return cap


def _padded(n: int, r: int) -> int:
    return ((r + 15) // 16) * 16  # a graph's row bucket


def test_the_array_search_chooses_as_the_enumeration():
    rng = random.Random(0)
    speculated = ties = 0
    for trial in range(1500):
        block, n = rng.choice([4, 8, 16]), rng.choice([2, 3, 8, 16, 32])
        cost = CostModel.linear(
            rng.uniform(1e-3, 5e-3), rng.uniform(-1e-5, 5e-5), rng.uniform(1e-6, 2e-5), rng.uniform(2e-4, 2e-3),
            rng.uniform(1e-6, 8e-5), p0=rng.uniform(1e-3, 5e-3), p1=rng.uniform(0.0, 3e-5),
        )  # fmt: skip
        if rng.random() < 0.5:  # some draft buckets measured, as the GPU engine's tables are
            for m in rng.sample(range(1, n + 1), min(n, 4)):
                cost.seed("draft", m, rng.uniform(2e-4, 2e-3))
        if rng.random() < 0.5:  # score caps, some measured cheaper (graph_setup.draft_score_caps)
            cost.draft_cap = _score_cap(block)
            for m in rng.sample(range(1, n + 1), min(n, 4)):
                for cap in {4, 8} & set(range(2, block)):
                    cost.seed("draft", (m, cap), rng.uniform(1e-4, 1.5e-3))
        tables = [geometric_table(rng.choice([0.0, rng.uniform(0.0, 0.95)]), block) for _ in range(n)]
        tables = [[0.0] + [1.0] * block if rng.random() < 0.15 else t for t in tables]  # retired requests
        remaining = [rng.choice([1, 2, 3, rng.randint(1, 200)]) for _ in range(n)]
        rows, switch_s = rng.choice([real_rows, _padded]), rng.choice([0.0, 1e-3])
        want = _enumerated(tables, remaining, block, cost, rows, switch_s)
        got = choose_spans(tables, remaining, block, cost, rows, switch_s=switch_s)
        where = f"trial {trial}: n={n} B={block} remaining={remaining}"
        if want is None:
            assert got.cap == 1 and got.spans == [1] * n, f"{where}: plain expected, got {got}"
            continue
        speculated += 1
        rate, spans, cap = want
        assert abs(got.predicted_tok_per_s - rate) <= 1e-9 * rate, f"{where}: rate {got.predicted_tok_per_s} vs {rate}"
        if (got.spans, got.cap) != (spans, cap):
            ties += 1  # the same rate from another candidate: the enumeration's pick was a rounding difference
    assert speculated > 300, f"only {speculated} of 1500 trials speculated: the test checks too little"
    assert ties <= 0.02 * speculated, f"{ties} of {speculated} differ at an equal rate: more than rounding"


def test_draft_costs_equal_draft_s_at_every_count():
    cost = CostModel.linear(4e-3, 1e-5, 8e-6, 1e-3, 6e-5)
    cost.draft_bucket = lambda m: 1 << (m - 1).bit_length()  # powers of two, as graph buckets
    cost.seed("draft", 8, 1.7e-3)
    cost.seed("draft", 32, 3.1e-3)
    got, want = cost.draft_costs(40), [cost.draft_s(m) for m in range(41)]
    assert got == want, f"first difference at m={next(m for m in range(41) if got[m] != want[m])}"
    cost.draft_cap = _score_cap(16)
    cost.seed("draft", (8, 4), 0.9e-3)  # bucket 8's 4-cap shape: the others price as the full block's
    for span in (0, 2, 4, 5, 16):
        got, want = cost.draft_costs(40, span), [cost.draft_s(m, span) for m in range(41)]
        assert got == want, f"span {span}: first difference at m={next(m for m in range(41) if got[m] != want[m])}"
    assert cost.draft_s(6, 3) == 0.9e-3 and cost.draft_s(6, 5) == cost.draft_s(6) == 1.7e-3


def test_tables_from_the_array_pass_are_the_same_floats(monkeypatch):
    rng = random.Random(1)
    est = AcceptanceEstimates(16)
    for r in range(40):
        for _ in range(rng.randint(0, 6)):
            est.observe(r, rng.choice([4, 16]), rng.randint(0, 3))
    ids = list(range(48))  # 8 without evidence: the first blocks' table
    arrays = est.tables(ids)
    monkeypatch.setattr(acceptance_estimate, "ARRAY_TABLES", 10**9)
    python = est.tables(ids)
    diff = [i for i, (a, b) in enumerate(zip(arrays, python)) if a != b]
    assert not diff, f"request {diff[0]}: {arrays[diff[0]]} vs {python[diff[0]]}"
