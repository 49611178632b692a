"""The prefix cache's acceptance-equality gate has teeth (CPU fp32): two deliberately broken engines whose
outputs stay lossless, so no token-equality gate sees them, fail it (tests/prefix_scenarios.py: per request,
cache on vs off, accepted lengths per verify step, drafts and the first draft's logits). One skips the drafter
context a hit brings (the rows claimed projected, never projected: the drafter reads stale pages); the other
lets drafting requests take blocks a logprobs request cached without tap features (check_integrity names it
at the first such hit; with the per-block flag gone altogether, the gate fails).

Run: pytest tests/golden/test_prefix_cache_gate.py      (a real pair too with REFENGINE_TARGET_PATH /
REFENGINE_DRAFT_PATH set)
"""

from __future__ import annotations

from contextlib import ExitStack
from unittest.mock import patch

import pytest

from refengine.errors import IntegrityError
from refengine.kv.pool import KvPool
from refengine.kv.prefix_cache import PrefixCache
from refengine.spec_decode.lane import DFlashLane
from tests.adapter import assert_same_tokens, cpu_engine
from tests.prefix_scenarios import QUESTIONS, chat, first_then_together, mismatches, params, run_both, run_until


def _skip_cached_context(self, req_id: int, rows: int) -> None:
    self._ctx[req_id].length += rows  # claimed projected, never projected: the drafter reads stale pages


def _concurrent_chats(pair):
    return first_then_together([chat(pair, q) for q in QUESTIONS], 24)


def test_gate_fails_a_hit_that_skips_the_drafter_context(model_pair):
    runs = run_both(
        model_pair,
        _concurrent_chats(model_pair),
        broken=lambda: patch.object(DFlashLane, "attach_cached", _skip_cached_context),
    )
    (_, off, _), (_, on, _) = runs[False], runs[True]
    for i, (a, b) in enumerate(zip(off, on)):  # still lossless: only the gate below sees it
        assert_same_tokens(b.output_ids, a.output_ids, f"broken engine request {i}")
    bad = mismatches(runs)
    assert bad, "the acceptance gate passed an engine whose hits skip the drafter context"
    print("expected failure:\n" + "\n".join(bad[:4]))


def test_gate_fails_a_drafting_hit_on_featureless_blocks(model_pair):
    """A port without the per-block features flag: drafting requests take blocks a logprobs request cached.
    check_integrity names it at the first such hit; with the flag gone altogether, the gate fails."""
    lookup = KvPool.lookup

    def any_block(self, prompt_len, keys, need_features):
        return lookup(self, prompt_len, keys, False)

    def flow(engine):
        first = engine.add_request(chat(model_pair, QUESTIONS[0]), params(16, logprobs=2))
        run_until(engine, [first])
        reqs = [first] + [engine.add_request(chat(model_pair, q), params(24)) for q in QUESTIONS[1:5]]
        run_until(engine, reqs)
        return reqs

    with patch.object(KvPool, "lookup", any_block), pytest.raises(IntegrityError, match="tap features"):
        flow(cpu_engine(model_pair.target, model_pair.draft, enable_prefix_caching=True))

    def no_flag():
        stack = ExitStack()
        stack.enter_context(patch.object(KvPool, "lookup", any_block))
        stack.enter_context(patch.object(PrefixCache, "lacks_features", lambda self, block: False))
        return stack

    runs = run_both(model_pair, flow, broken=no_flag)
    assert all(r.cached_tokens for r in runs[True][1][1:]), "the broken engine must hit the featureless blocks"
    bad = mismatches(runs)
    assert bad, "the acceptance gate passed drafting requests that took blocks without tap features"
    print("expected failure:\n" + "\n".join(bad[:4]))
