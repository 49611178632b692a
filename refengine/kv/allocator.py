"""Block allocator: a free list, per-request block tables and, with a prefix cache (kv/prefix_cache.py),
reference counts: a cached block may sit in several tables, and goes back to the free list (or, while
cached, to the cache's evictable blocks) when the last table holding it lets it go."""

from __future__ import annotations

from refengine.errors import IntegrityError, KvAllocationError
from refengine.kv.prefix_cache import PrefixCache


class BlockAllocator:
    def __init__(self, num_blocks: int, cache: PrefixCache | None = None):
        if num_blocks <= 0:
            raise KvAllocationError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self.cache = cache
        # A stack: the most recently freed block is reused first (LIFO keeps rollback cheap to reason about).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}  # with a cache: tables holding each held block
        self.table_blocks = 0  # the tables' total length (blocks in use when nothing is shared)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: the free list plus cached blocks no table holds."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    def table(self, req_id: int) -> list[int]:
        return self._tables.get(req_id, [])

    def owners(self) -> list[int]:
        """Requests that own a block table (possibly empty)."""
        return list(self._tables)

    def allocate(self, req_id: int, n: int) -> list[int]:
        """Append n fresh blocks to req_id's table; all or nothing. The free list goes first; cached blocks
        no table holds are evicted (least recently used first) only when it is empty."""
        if n < 0:
            raise KvAllocationError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise KvAllocationError(f"request {req_id} needs {n} blocks, only {self.num_free} free")
        got = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        if self.cache is not None:
            for b in got:
                self._refs[b] = 1
        self._tables.setdefault(req_id, []).extend(got)
        self.table_blocks += n
        return got

    def _evict(self) -> int:
        assert self.cache is not None  # num_free counted evictable blocks only with a cache
        return self.cache.evict()

    def share(self, req_id: int, blocks: list[int]) -> None:
        """Append cached blocks (a prefix-cache hit) to req_id's table, one more reference each."""
        cache = self.cache
        if cache is None:
            raise KvAllocationError("blocks shared without a prefix cache")
        for b in blocks:
            if not cache.holds(b):
                raise KvAllocationError(f"request {req_id}: block {b} shared but not cached")
            n = self._refs.get(b, 0)
            if n == 0:
                cache.unpark(b)
            self._refs[b] = n + 1
        self._tables.setdefault(req_id, []).extend(blocks)
        self.table_blocks += len(blocks)

    def register(self, key: bytes, block: int, has_features: bool) -> None:
        """Put a held, full, committed block in the prefix cache under `key` (kv/prefix_cache.py)."""
        assert self.cache is not None
        displaced = self.cache.insert(key, block, has_features)
        if displaced is not None:
            self._free.append(displaced)

    def _let_go(self, block: int) -> None:
        """One table no longer holds `block`."""
        if self.cache is None:
            self._free.append(block)
            return
        n = self._refs[block] - 1
        if n:
            self._refs[block] = n
            return
        del self._refs[block]
        if self.cache.holds(block):
            self.cache.park(block)
        else:
            self._free.append(block)

    def free_tail(self, req_id: int, n: int) -> None:
        """Give back the last n blocks of req_id's table, last in first out."""
        table = self._tables.get(req_id, [])
        if n > len(table):
            raise KvAllocationError(f"request {req_id} owns {len(table)} blocks, cannot free {n}")
        for _ in range(n):
            self._let_go(table.pop())
        self.table_blocks -= n

    def free_request(self, req_id: int) -> None:
        table = self._tables.pop(req_id, [])
        self.table_blocks -= len(table)
        if self.cache is None:
            self._free.extend(reversed(table))
            return
        for b in reversed(table):  # the tail first: a prefix's last blocks are evicted before its first
            self._let_go(b)

    def check_integrity(self) -> None:
        """free + used == total, and no block is owned twice or both owned and free; with a prefix cache,
        reference counts match the tables, only cached blocks are shared, and every block is exactly one of
        free, held by tables, or cached and evictable."""
        used = [b for t in self._tables.values() for b in t]
        if len(used) != self.table_blocks:
            raise IntegrityError(f"tables hold {len(used)} blocks, the allocator counts {self.table_blocks}")
        if self.cache is not None:
            self._check_shared(used)
            return
        every = used + self._free
        if len(every) == self.num_blocks == len(set(every)) and (
            not every or 0 <= min(every) and max(every) < self.num_blocks
        ):
            return  # the fast path (called after every step in the tests); the loop below names the fault
        seen = set()
        for b in used + self._free:
            if not 0 <= b < self.num_blocks:
                raise IntegrityError(f"block id {b} outside 0..{self.num_blocks - 1}")
            if b in seen:
                raise IntegrityError(f"block {b} appears twice (owned twice, or owned and free)")
            seen.add(b)
        if len(used) + len(self._free) != self.num_blocks:
            raise IntegrityError(f"free {len(self._free)} + used {len(used)} != total {self.num_blocks}")

    def _check_shared(self, used: list[int]) -> None:
        assert self.cache is not None
        counts: dict[int, int] = {}
        for b in used:
            counts[b] = counts.get(b, 0) + 1
        if counts != self._refs:
            wrong = sorted(b for b in counts.keys() | self._refs.keys() if counts.get(b) != self._refs.get(b))
            raise IntegrityError(
                "reference counts disagree with the tables for blocks "
                + ", ".join(f"{b}: {self._refs.get(b, 0)} counted, {counts.get(b, 0)} held" for b in wrong[:8])
            )
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a block is on the free list twice")
        held = set(counts)
        if free & held:
            raise IntegrityError(f"blocks {sorted(free & held)[:8]} are both held and free")
        self.cache.check_integrity(held, free)
        every = len(free) + len(held) + self.cache.num_evictable
        bad = [b for b in free | held if not 0 <= b < self.num_blocks]
        if bad or every != self.num_blocks:
            raise IntegrityError(
                f"free {len(free)} + held {len(held)} + evictable {self.cache.num_evictable} != total "
                f"{self.num_blocks} (ids outside the pool: {bad[:8]})"
            )
