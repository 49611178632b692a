"""The block prefix cache (refengine/kv/prefix_cache.py) inside the KV pool and allocator: reference counts,
LRU eviction of unreferenced blocks only, only committed blocks cached, hits counted as paid at admission,
the per-block "has features" flag, and check_integrity catching reference-count and cache corruption.

A hypothesis state test shadows every block's contents (the tokens written into it) and checks that a hit
only ever hands out blocks holding exactly the prompt's prefix, through admissions, growth, speculative
rollbacks, releases and evictions.

Run: pytest tests/unit/test_kv_prefix_cache.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine.errors import IntegrityError
from refengine.kv import KvPool
from refengine.kv.pool import blocks_for

PAGE = 4


def _pool(num_blocks: int) -> KvPool:
    return KvPool(1, num_blocks, PAGE, 1, 2, torch.float32, torch.device("cpu"), prefix_caching=True)


def _admit(pool: KvPool, rid: int, prompt: list[int], max_tokens: int, features: bool = True) -> int | None:
    """Admit like the scheduler does; the tokens taken from the cache, or None if it does not fit."""
    keys = pool.prompt_keys(prompt)
    hit = pool.lookup(len(prompt), keys, features)
    if not pool.can_admit(len(prompt) + max_tokens, hit):
        return None
    pool.admit(rid, len(prompt) + max_tokens, hit, keys)
    pool.extend(rid, len(prompt) - len(hit) * PAGE)
    return len(hit) * PAGE


def _register(pool: KvPool, rid: int, tokens: list[int], features: bool = True) -> None:
    pool.register(rid, pool.seq_len[rid], lambda a, b: tokens[a:b], features)


def test_hit_shares_blocks_and_counts_them_as_paid():
    pool = _pool(8)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert _admit(pool, 0, prompt, 2) == 0
    _register(pool, 0, prompt)
    assert pool.prefix_cache.num_cached == 2
    # 3 lifetime blocks, 2 of them shared: it needs only 1 more block, though 5 blocks are held or promised
    assert _admit(pool, 1, prompt[:9] + [99], 2) == 8
    assert pool.table(1)[:2] == pool.table(0)[:2], "the hit must share request 0's blocks"
    assert pool.allocator.num_free == 8 - 3 - 1
    pool.check_integrity()
    pool.release(0)
    pool.release(1)
    assert pool.prefix_cache.num_evictable == 2 and pool.allocator.num_free == 8
    pool.check_integrity()


def test_a_full_prompt_leaves_its_last_token_to_prefill():
    pool = _pool(8)
    prompt = list(range(8))  # exactly 2 blocks
    _admit(pool, 0, prompt, 1)
    _register(pool, 0, prompt)
    got = _admit(pool, 1, prompt, 1)
    assert got == 4, f"a prompt of 8 tokens took {got} from the cache; 4 (one block) leaves its last token to run"


def test_lru_evicts_only_unreferenced_blocks_least_recent_first():
    pool = _pool(6)
    a, b = [1] * 8, [2] * 8
    _admit(pool, 0, a, 0)
    _register(pool, 0, a)
    _admit(pool, 1, b, 0)
    _register(pool, 1, b)
    pool.release(0)  # a's blocks evictable first (its tail before its head), then b's
    pool.release(1)
    assert _admit(pool, 2, [3] * 8 + [4], 0) == 0  # 3 blocks: 2 free, then a's tail block
    cache = pool.prefix_cache
    assert cache.stats.evicted == 1
    assert pool.lookup(9, pool.prompt_keys(a + [0]), True) == pool.lookup(5, pool.prompt_keys(a[:4] + [0]), True)
    assert len(pool.lookup(9, pool.prompt_keys(b + [0]), True)) == 2, "b was used later: it must survive"
    hit = pool.lookup(9, pool.prompt_keys(b + [0]), True)
    _admit(pool, 3, b + [0], 0)
    assert pool.table(3)[:2] == hit
    with pytest.raises(Exception, match="free"):  # nothing left: b's blocks are referenced, not evictable
        pool.allocator.allocate(9, 2)
    pool.check_integrity()


def test_speculative_blocks_never_enter_the_cache():
    pool = _pool(8)
    prompt = [5] * 6
    _admit(pool, 0, prompt, 10)
    res = pool.schedule_speculative({0: 5})  # positions 6..10: block 1 fills, block 2 opens
    pool.apply_speculative(0, 1, res)  # one token committed: length 7, block 1 not yet full
    pool.revert_schedule(res)
    _register(pool, 0, prompt + [7] + [8] * 4)
    assert pool.prefix_cache.num_cached == 1, "only the committed full block may be cached"
    pool.check_integrity()


def test_features_flag_stops_a_drafting_hit_and_an_upgrade_replaces_the_block():
    pool = _pool(12)
    prompt = list(range(12))
    _admit(pool, 0, prompt, 0, features=False)
    _register(pool, 0, prompt, features=False)  # a request that did not draft: no features
    assert _admit(pool, 1, prompt + [1], 0, features=True) == 0, "a drafting request must not take featureless blocks"
    assert _admit(pool, 2, prompt + [2], 0, features=False) == 12
    _register(pool, 1, prompt + [1], features=True)  # the drafting request's own copies replace them
    assert pool.lookup(13, pool.prompt_keys(prompt + [3]), True) == pool.table(1)[:3]
    pool.release(0)
    pool.release(2)  # request 0's old blocks, no longer cached, go back to the free list
    assert pool.prefix_cache.num_cached == 3 and pool.allocator.num_free == 12 - 4
    pool.check_integrity()


def test_integrity_catches_a_bad_reference_count_and_a_free_cached_block():
    pool = _pool(8)
    prompt = list(range(9))
    _admit(pool, 0, prompt, 0)
    _register(pool, 0, prompt)
    _admit(pool, 1, prompt, 0)
    pool.check_integrity()
    block = pool.table(0)[0]
    pool.allocator._refs[block] = 1  # one of the two tables' references lost: a release would free it early
    with pytest.raises(IntegrityError, match=f"{block}: 1 counted, 2 held"):
        pool.check_integrity()
    pool.allocator._refs[block] = 2
    pool.release(0)
    pool.release(1)
    pool.allocator._free.append(pool.prefix_cache._evictable.popitem()[0])  # double free: cached and free
    with pytest.raises(IntegrityError, match="cached and free"):
        pool.check_integrity()


OPS = ["admit", "admit", "grow", "spec", "release", "release"]
ops = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 5), st.integers(0, 30)), min_size=20, max_size=80)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(3, 10), ops=ops)
def test_hits_only_ever_hand_out_the_prompts_prefix(num_blocks, ops):
    pool = _pool(num_blocks)
    tokens: dict[int, list[int]] = {}
    shadow: dict[int, tuple[int, ...]] = {}  # block -> the tokens before its end, as written

    def write(rid: int, start: int, end: int) -> None:
        table, seq = pool.table(rid), tokens[rid]
        for i in range(start // PAGE, blocks_for(end, PAGE)):
            shadow[table[i]] = tuple(seq[: min((i + 1) * PAGE, end)])

    next_id = 100
    for op, who, n in ops:
        if op == "admit":
            # prompts on three stems (two sharing their first block) share prefixes often
            stem = ([0] * 20, [0] * 8 + [1] * 12, [1] * 20)[who % 3]
            prompt = stem[: 1 + n % 20] + [n % 2] * (n // 20)
            rid, next_id = next_id, next_id + 1
            cached = _admit(pool, rid, prompt, 1 + n % 4, features=who < 4)
            if cached is None:
                continue
            tokens[rid] = prompt
            for i, b in enumerate(pool.table(rid)[: cached // PAGE]):
                want = tuple(prompt[: (i + 1) * PAGE])
                assert shadow.get(b) == want, f"hit block {i} (id {b}) holds {shadow.get(b)}, the prompt {want}"
            write(rid, cached, len(prompt))
            _register(pool, rid, prompt, who < 4)
        elif tokens:
            rid = sorted(tokens)[who % len(tokens)]
            length, room = pool.seq_len[rid], pool.lifetime_blocks[rid] * PAGE - pool.seq_len[rid]
            if op == "release":
                pool.release(rid)
                del tokens[rid]
            elif op == "grow" and room:
                k = 1 + n % room
                tokens[rid] += [n % 2] * k
                pool.extend(rid, k)
                write(rid, length, length + k)
                _register(pool, rid, tokens[rid])
            elif op == "spec" and room:
                span = 1 + n % min(room, 5)
                res = pool.schedule_speculative({rid: span})
                drafts = [(n + j) % 2 for j in range(span)]
                tokens[rid] += drafts
                write(rid, length, length + span)  # the verify writes the whole span
                keep = 1 + n % span
                pool.apply_speculative(rid, keep, res)
                pool.revert_schedule(res)
                del tokens[rid][length + keep :]
                _register(pool, rid, tokens[rid])
        pool.check_integrity()
    for rid in list(tokens):
        pool.release(rid)
    pool.check_integrity()
    assert pool.allocator.num_free == num_blocks, "blocks leaked after every request was released"
