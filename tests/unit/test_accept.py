"""accept_greedy and build_verify_results: the pure acceptance rule (longest matching prefix + bonus,
EOS truncation inside the committed run).

Run: pytest tests/unit/test_accept.py
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refengine.spec_decode.accept import accept_greedy, build_verify_results


def test_accept_examples():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == 0
    assert accept_greedy([], [4]) == 0
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


@given(st.lists(st.integers(0, 3), max_size=15), st.data())
def test_accept_is_longest_matching_prefix(drafts, data):
    target = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    m = accept_greedy(drafts, target)
    assert drafts[:m] == target[:m]
    assert m == len(drafts) or drafts[m] != target[m]


def test_verify_results_commit_and_eos():
    (r,) = build_verify_results([[5, 6, 7]], [[5, 6, 9, 8]], eos_ids={2}, ignore_eos=[False])
    assert (r.accepted, r.new_tokens, r.hit_eos, r.committed) == (2, (5, 6, 9), False, 3)
    (r,) = build_verify_results([[5, 2, 7]], [[5, 2, 7, 8]], eos_ids={2}, ignore_eos=[False])
    assert r.new_tokens == (5, 2) and r.hit_eos and r.committed == 2
    (r,) = build_verify_results([[5, 2, 7]], [[5, 2, 7, 8]], eos_ids={2}, ignore_eos=[True])
    assert r.new_tokens == (5, 2, 7, 8) and not r.hit_eos
    (r,) = build_verify_results([[5]], [[2, 3]], eos_ids={2}, ignore_eos=[False])  # bonus is EOS
    assert r.new_tokens == (2,) and r.hit_eos
