"""Prefix caching under the forced-acceptance test proposers (tests/proposers.py), CPU fp32: requests on
shared prefixes, the later ones admitted while earlier ones run and hitting their cached blocks (whose rows
reach the proposer through attach_cached, before the prefill's own), must produce plain greedy's output
exactly whatever the drafts: the oracle commits every span whole, and hypothesis picks which drafts of the
noisy proposer go wrong. The transaction (reserve, verify, commit, roll back) runs over shared blocks. Prompt
ids are below 1023, valid in every pair's vocabulary.

Run: pytest tests/golden/test_lossless_prefix_cache_proposers.py
"""

from __future__ import annotations

import json
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refengine import SamplingParams
from tests.adapter import assert_same_tokens, cpu_engine, greedy
from tests.proposers import ReplayProposer, oracle, oracle_runs

B = 16


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    stems = [[rng.randrange(1023) for _ in range(rng.choice([17, 33, 40]))] for _ in range(2)]
    return [stems[i % 2] + [rng.randrange(1023) for _ in range(rng.choice([1, 5, 16]))] for i in range(6)]


def _vocab(pair) -> int:
    return json.loads((pair.target / "config.json").read_text())["vocab_size"]


def _run(pair, proposer, prompts, budgets) -> list:
    plain = greedy(cpu_engine(pair.target), prompts, budgets)
    engine = cpu_engine(pair.target, proposer=proposer, enable_prefix_caching=True)
    reqs = []
    for i, (p, m, ref) in enumerate(zip(prompts, budgets, plain)):
        r = engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        proposer.expect(r.request_id, len(p), ref)
        reqs.append(r)
        for _ in range(i % 3):  # staggered: the later requests find the earlier ones' blocks cached
            engine.step()
    while engine.has_work():
        engine.step()
    for i, (r, ref) in enumerate(zip(reqs, plain)):
        assert_same_tokens(r.output_ids, ref, f"request {i} (cached {r.cached_tokens} tokens, max_tokens {budgets[i]})")
    assert any(r.cached_tokens for r in reqs), f"no request hit: cached {[r.cached_tokens for r in reqs]}"
    engine.check_integrity()
    assert engine.pool.allocator.num_free == engine.pool.num_blocks, "blocks leaked"
    return reqs


def test_lossless_prefix_cache_oracle_commits_every_span(model_pair):
    budgets = [1, B - 1, B, B + 1, 2 * B + 3, 40]
    for r, m in zip(_run(model_pair, oracle(B, _vocab(model_pair)), _prompts(0), budgets), budgets):
        got, expected = sorted(r.spec.accepted_hist.elements()), oracle_runs(m, B)
        assert got == expected, f"cached {r.cached_tokens}, max_tokens {m}: runs {got}, want {expected}"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    wrong=st.sets(st.tuples(st.integers(0, 5), st.integers(0, 6), st.integers(1, B - 1)), max_size=30),
)
def test_lossless_prefix_cache_noisy_proposer(model_pair, seed, wrong):
    proposer = ReplayProposer(B, _vocab(model_pair), corrupt=lambda req_id, step, j: (req_id, step, j) in wrong)
    budgets = [random.Random(seed + i).choice([2, B, B + 1, 30]) for i in range(6)]
    _run(model_pair, proposer, _prompts(seed), budgets)
