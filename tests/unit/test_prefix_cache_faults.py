"""Prefix caching through failed steps and aborts: with requests sharing cached blocks, a fault in a prefill
(with hits), a verify, a draft or inside commit, and aborts of requests mid-run, leave nothing leaked or
double-freed: integrity (reference counts against the tables, the cache's blocks evictable exactly when no
table holds them, nothing both cached and free) holds after every step (conftest), and once every request
is done every block is free or cached-and-evictable, no reference is left, and the requests outside the
failed plans produce exactly their cache-off bs=1 outputs. A rolled-back prefill's blocks are never cached
(nor its lookup counted twice in the stats), and check_integrity names a drafting request holding a cached
block without tap features. Admission waits
for the drafter's per-request pages that shared target blocks do not bring (a broken engine without that
check fails its requests).

Run: python -m pytest -q tests/unit/test_prefix_cache_faults.py
"""

from __future__ import annotations

import pytest

from refengine import FinishReason, SamplingParams
from refengine.errors import IntegrityError
from tests.adapter import assert_same_tokens, cpu_engine, greedy
from tests.faults import FaultInjector

SHARED = [7, 11, 13, 17, 19, 23, 29, 31] * 5  # 40 tokens: two whole blocks and 8 of a third
PROMPTS = [SHARED + [i, i + 1, i + 2] for i in range(100, 106)]
BUDGET = 14


@pytest.fixture(scope="module")
def refs(random_pair) -> list[list[int]]:
    engine = cpu_engine(random_pair.target, max_num_seqs=1)
    return [greedy(engine, [p], BUDGET)[0] for p in PROMPTS]


def _engine(pair):
    return cpu_engine(pair.target, pair.draft, num_blocks=40, enable_prefix_caching=True)


def _add(engine, i):
    return engine.add_request(PROMPTS[i], SamplingParams(max_tokens=BUDGET, ignore_eos=True))


def _drain_clean(engine, limit=300) -> None:
    for _ in range(limit):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work(), f"still working after {limit} steps"
    alloc, cache = engine.pool.allocator, engine.pool.prefix_cache
    assert alloc.num_free == engine.pool.num_blocks, f"{engine.pool.num_blocks - alloc.num_free} blocks leaked"
    assert alloc._refs == {}, f"references left: {alloc._refs}"
    assert cache.num_evictable == cache.num_cached, f"{cache.num_cached - cache.num_evictable} cached blocks held"
    assert engine.proposer.live_requests() == set(), "drafter contexts leaked"


def _exact(reqs, refs, idx, label):
    for r, i in zip(reqs, idx):
        assert r.finish_reason is FinishReason.LENGTH, f"{label}: request {r.request_id}: {r.finish_reason} {r.message}"
        assert_same_tokens(r.output_ids, refs[i], f"{label}: request {r.request_id} (prompt {i})")


@pytest.mark.parametrize(
    "point,at,after",
    [("prefill", 1, False), ("prefill", 1, True), ("verify", 2, True), ("draft", 1, False), ("commit", 3, True)],
)
def test_a_fault_with_shared_blocks_leaks_nothing(random_pair, refs, point, at, after):
    engine = _engine(random_pair)
    first = _add(engine, 0)
    while not first.finished:  # its prompt's blocks cached: the next prefill hits them
        engine.step()
    inj = FaultInjector(engine, point, at=at, times=1, after=after)
    reqs = [_add(engine, i) for i in range(1, 4)]
    engine.step()
    reqs += [_add(engine, i) for i in range(4, 6)]
    _drain_clean(engine)
    assert inj.fired == 1, f"the {point} fault fired {inj.fired} times"
    assert all(r.cached_tokens == 32 for r in reqs), f"cached tokens {[r.cached_tokens for r in reqs]}"
    failed = [r for r in reqs if r.finish_reason is FinishReason.ERROR]
    assert (point == "commit") == bool(failed), f"{point}: requests finished with ERROR: {failed}"
    _exact(
        [first] + [r for r in reqs if r not in failed],
        refs,
        [0] + [r.request_id for r in reqs if r not in failed],
        point,
    )


def test_aborts_of_requests_sharing_blocks_leak_nothing(random_pair, refs):
    engine = _engine(random_pair)
    first = _add(engine, 0)
    engine.step()  # prefilled: its blocks are cached and held
    reqs = [_add(engine, i) for i in range(1, 6)]
    engine.step()
    engine.abort(first.request_id)  # the blocks' first owner goes while others share them
    engine.step()
    engine.abort(reqs[1].request_id)
    waiting = _add(engine, 2)
    engine.abort(waiting.request_id)  # aborted before admission
    _drain_clean(engine)
    kept = [r for r in reqs if r.finish_reason is not FinishReason.ABORTED]
    assert len(kept) == 4
    _exact(kept, refs, [r.request_id for r in kept], "aborts")


def test_a_rolled_back_prefill_caches_nothing(random_pair):
    engine = _engine(random_pair)
    inj = FaultInjector(engine, "prefill", at=0, times=1, after=True)  # K/V written, then the step fails
    req = _add(engine, 0)
    engine.step()
    assert inj.fired == 1 and engine.pool.prefix_cache.num_cached == 0, "a failed prefill's blocks were cached"
    _drain_clean(engine)
    assert req.finish_reason is FinishReason.LENGTH and engine.pool.prefix_cache.num_cached > 0
    stats = engine.prefix_cache_stats()
    assert stats["queries"] == 1, f"the retried prefill's lookup counted twice: {stats}"


def test_integrity_catches_a_drafting_request_on_featureless_blocks(random_pair):
    engine = _engine(random_pair)
    first = _add(engine, 0)
    while not first.finished:
        engine.step()
    second = _add(engine, 1)
    engine.step()  # its prefill took two cached blocks
    block = engine.pool.table(second.request_id)[0]
    engine.pool.prefix_cache._entries[block].has_features = False  # as if a plain request had cached it
    with pytest.raises(IntegrityError, match=f"cached blocks \\[{block}\\] whose tap features are not in the store"):
        engine.check_integrity()


def test_admission_waits_for_drafter_pages_shared_blocks_do_not_bring(random_pair):
    """8 requests on one 64-token prefix in a 12-block pool: sharing it, the target admits all 8 at once,
    but each drafter context is its own 6 pages of a 20-page lane pool (12 + 8 requests x 1 scratch page).
    Admission waits for those pages (Proposer.can_start); without that check the drafter context cannot be
    allocated and the requests fail."""
    shared = list(range(200, 264))
    prompts = [shared + [i, i + 1] for i in range(8)]
    plain = cpu_engine(random_pair.target, max_num_seqs=1)
    refs = [greedy(plain, [p], 14)[0] for p in prompts]

    def run(engine):
        first = engine.add_request(prompts[0], SamplingParams(max_tokens=14, ignore_eos=True))
        while not first.finished:
            engine.step()
        reqs = [first] + [engine.add_request(p, SamplingParams(max_tokens=14, ignore_eos=True)) for p in prompts[1:]]
        most = 0
        while engine.has_work():
            engine.step()
            most = max(most, len(engine.scheduler.running))
        return reqs, most

    reqs, most = run(
        cpu_engine(random_pair.target, random_pair.draft, num_blocks=12, max_num_seqs=8, enable_prefix_caching=True)
    )
    _exact(reqs, refs, range(8), "drafter pages")
    assert most == 3, f"{most} requests ran at once; the lane's 20 pages hold 3 contexts of 6"
    broken = cpu_engine(
        random_pair.target, random_pair.draft, num_blocks=12, max_num_seqs=8, enable_prefix_caching=True
    )
    broken.proposer.can_start = lambda capacities: True  # type: ignore[method-assign]
    reqs, _ = run(broken)
    errors = [r.message for r in reqs if r.finish_reason is FinishReason.ERROR]
    assert errors and "drafter pool cannot hold" in errors[0], f"without the check: {errors[:1]}"
