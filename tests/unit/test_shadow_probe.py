"""Shadow probes' bookkeeping (refengine/spec_decode/shadow_probe.py) and the policy's side of them: the answer
is the longest prefix of the drafts that the committed tokens match, known at the first mismatch or after
the last draft, and a request that finishes first reports only what it compared; a request awaiting an
answer is neither probed again nor retired, and only a plain choice's probes may be shadows.

Run: pytest tests/unit/test_shadow_probe.py
"""

from __future__ import annotations

import pytest

from refengine.spec_decode.adaptive import AdaptivePolicy
from refengine.spec_decode.shadow_probe import ShadowProbes
from refengine.spec_decode.step_costs import CostModel


def test_the_answer_is_the_matching_prefix_known_as_soon_as_the_tokens_decide():
    s = ShadowProbes()
    s.start(1, first=3, drafts=[7, 8, 9], span=4)  # d_1 predicts output_ids[3]
    assert s.settle(1, [0, 0, 0], finished=False) is None  # nothing compared yet
    assert s.settle(1, [0, 0, 0, 7], finished=False) is None  # d_1 matched, d_2 not yet decoded
    assert s.settle(1, [0, 0, 0, 7, 5], finished=False) == (4, 1)  # d_2 missed: one accepted, closed
    assert 1 not in s.open
    s.start(2, first=0, drafts=[4, 4], span=3)
    assert s.settle(2, [4, 4, 1], finished=False) == (3, 2)  # every draft matched
    s.start(3, first=0, drafts=[6, 6, 6], span=4)
    assert s.settle(3, [6], finished=True) == (2, 1)  # finished after one comparison: a span-2 answer
    s.start(4, first=2, drafts=[6], span=2)
    assert s.settle(4, [1, 2], finished=True) is None and not s.open  # nothing compared: no answer
    s.start(5, first=0, drafts=[3], span=2)
    assert s.settle(5, [2], finished=False) == (2, 0)  # tau 1: the step that launched it answers
    with pytest.raises(ValueError, match="span 3 with 1 drafts"):
        s.start(6, first=0, drafts=[1], span=3)


def _plain_policy() -> AdaptivePolicy:
    """A policy whose costs make plain win (a draft + verify dearer than four plain steps) and whose first
    blocks are known to accept poorly, so new requests are probed by a plain choice."""
    p = AdaptivePolicy(16, cost=CostModel.linear(5e-3, 1e-5, 8e-6, 1.2e-3, 7e-5, p0=1e-3, p1=1e-5))
    p.cost.plain.updates = p.cost.verify.updates = 1
    p._next_explore = 10**9
    for rid in range(-1, -21, -1):
        p.observe_acceptance(rid, 16, 0)
        p.release(rid)
    return p


def test_a_request_awaiting_its_shadow_is_not_probed_again_and_answers_like_a_verify():
    p = _plain_policy()
    spans = p.choose([1, 2], [100, 100])
    probed = p.shadowable(spans)
    assert probed and p.last is not None and p.last.cap == 1 and all(spans[i] > 1 for i in probed), spans
    p.shadows_launched([[1, 2][i] for i in probed])
    again = p.choose([1, 2], [99, 99])
    assert again == [1, 1] and not p.shadowable(again), f"in flight, probed again: {again}"
    for i in probed:
        p.observe_shadow([1, 2][i], spans[i], 0)
    assert not p.in_flight and all(p.drafted[[1, 2][i]] == (1, 0) for i in probed), p.drafted
    assert p.summary()["shadows"] == len(probed)


def test_only_a_plain_choices_probes_may_be_shadows():
    p = _plain_policy()
    p.choose([1, 2], [100, 100])
    p.probed = [0]
    assert p.shadowable([16, 1]) == [0]
    assert p.shadowable([16, 2]) == [], "another request drafts: the step verifies anyway"
    p.probed = []
    assert p.shadowable([16, 1]) == [], "not a probe: an exploration or a speculating choice"


def test_shadow_probes_are_adaptive_speculations():
    from refengine.config import EngineConfig
    from refengine.errors import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match="shadow probes are adaptive speculation's"):
        EngineConfig("x", shadow_probes=True, speculation="fixed")
    assert EngineConfig("x", shadow_probes=False).shadow_probes is False  # off is fine anywhere
