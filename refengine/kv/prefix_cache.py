"""The block prefix cache of the target's KV pool: full, committed blocks found again by the tokens before
their end, so a request whose prompt starts with a cached prefix prefills only the rest.

A block's key is sha256(parent key, its page_size token ids): it names the whole prefix up to the block's
end, so equal keys mean equal K/V (one model, one engine). Only committed tokens are ever keyed: the
scheduler registers a request's full blocks after each commit (scheduler/prefix.py), so a rolled-back
speculative block never enters. The allocator (kv/allocator.py) counts the block tables holding each block;
a cached block no table holds stays here, evictable, and is taken back least recently used first, only
when the free list is empty.

`has_features` records that the block's rows were committed as drafter context by a drafting request, so
their tap features are in the feature store at the block's slots (spec_decode/feature_store.py: a row is
valid as long as its K/V, and a full block is never written again). A drafting request's hit stops at the
first block without them; a block with features registered over a key whose block has none replaces it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from refengine.errors import IntegrityError

ROOT_KEY = b""  # the parent key of a request's first block


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block holding `tokens` after the prefix keyed `parent`."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class CachedBlock:
    key: bytes
    has_features: bool


@dataclass
class PrefixCacheStats:
    """Counters since the engine started (lookups of committed prefills: a retried one counts once)."""

    queries: int = 0  # requests looked up
    hits: int = 0  # requests that got at least one block
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens served from the cache (not prefilled)
    inserted: int = 0  # blocks registered
    evicted: int = 0  # cached blocks taken back for other use

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens looked up."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._by_key: dict[bytes, int] = {}  # key -> block
        self._entries: dict[int, CachedBlock] = {}  # block -> its key and flag
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by no table; LRU first
        self.stats = PrefixCacheStats()

    def keys(self, tokens: Sequence[int], n_blocks: int, parent: bytes = ROOT_KEY, first: int = 0) -> list[bytes]:
        """Keys of blocks first .. n_blocks-1 of `tokens` (a request's tokens from position 0), chained from
        `parent`, the key of block first - 1."""
        out, page = [], self.page_size
        for i in range(first, n_blocks):
            parent = block_key(parent, tokens[i * page : (i + 1) * page])
            out.append(parent)
        return out

    def match(self, keys: Sequence[bytes], need_features: bool) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (stopping at the first block without features
        when `need_features`)."""
        blocks = []
        for k in keys:
            b = self._by_key.get(k)
            if b is None or (need_features and not self._entries[b].has_features):
                break
            blocks.append(b)
        return blocks

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        s = self.stats
        s.queries += 1
        s.hits += hit_tokens > 0
        s.query_tokens += prompt_tokens
        s.hit_tokens += hit_tokens

    def report(self) -> dict:
        """JSON-ready: `queries` (requests looked up) and `hits` (those that got a block); `query_tokens` /
        `hit_tokens` (prompt tokens looked up / served from the cache, not prefilled) and `hit_rate` (their
        ratio); `cached_blocks` and `evictable_blocks` now; `inserted` and `evicted` blocks since the start."""
        s = self.stats
        return {
            "enabled": True,
            "queries": s.queries,
            "hits": s.hits,
            "query_tokens": s.query_tokens,
            "hit_tokens": s.hit_tokens,
            "hit_rate": s.hit_rate,
            "cached_blocks": self.num_cached,
            "evictable_blocks": self.num_evictable,
            "inserted": s.inserted,
            "evicted": s.evicted,
        }

    # ---- what the allocator asks ------------------------------------------------------------------------
    def holds(self, block: int) -> bool:
        return block in self._entries

    def lacks_features(self, block: int) -> bool:
        """A cached block whose rows' tap features are not in the store."""
        entry = self._entries.get(block)
        return entry is not None and not entry.has_features

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def park(self, block: int) -> None:
        """The last table holding a cached block let it go: it becomes the most recently used evictable."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A table took an evictable block (a hit)."""
        del self._evictable[block]

    def evict(self) -> int:
        """Take the least recently used evictable block out of the cache (the caller reuses it)."""
        block, _ = self._evictable.popitem(last=False)
        del self._by_key[self._entries.pop(block).key]
        self.stats.evicted += 1
        return block

    def insert(self, key: bytes, block: int, has_features: bool) -> int | None:
        """Register a held, full, committed block under `key`. A key already cached keeps its block, unless
        that one lacks features and this one has them: then this one replaces it, and the old block is
        returned if no table holds it (the caller frees it; a held one is freed when its last table lets go)."""
        old = self._by_key.get(key)
        if old == block or block in self._entries:
            return None
        if old is not None and (self._entries[old].has_features or not has_features):
            return None  # this request's copy stays private, freed with it
        freed = None
        if old is not None:
            del self._entries[old]
            if old in self._evictable:
                del self._evictable[old]
                freed = old
        self._by_key[key] = block
        self._entries[block] = CachedBlock(key, has_features)
        self.stats.inserted += 1
        return freed

    def check_integrity(self, held: set[int], free: set[int]) -> None:
        """Keys and blocks agree one to one; evictable blocks are exactly the cached ones no table holds;
        no cached block is free."""
        if len(self._by_key) != len(self._entries) or any(self._entries[b].key != k for k, b in self._by_key.items()):
            raise IntegrityError("prefix cache: keys and blocks disagree")
        cached = set(self._entries)
        if cached & free:
            raise IntegrityError(f"prefix cache: blocks {sorted(cached & free)[:8]} are cached and free")
        idle = cached - held
        if idle != set(self._evictable):
            raise IntegrityError(
                f"prefix cache: evictable {sorted(self._evictable)[:8]} but cached blocks no table holds "
                f"are {sorted(idle)[:8]}"
            )
