"""Block allocator: a free list and per-request block tables. It never hashes (no prefix caching)."""

from __future__ import annotations

from refengine.errors import IntegrityError, KvAllocationError


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise KvAllocationError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        # A stack: the most recently freed block is reused first (LIFO keeps rollback cheap to reason about).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def table(self, req_id: int) -> list[int]:
        return self._tables.get(req_id, [])

    def owners(self) -> list[int]:
        """Requests that own a block table (possibly empty)."""
        return list(self._tables)

    def allocate(self, req_id: int, n: int) -> list[int]:
        """Append n fresh blocks to req_id's table; all or nothing."""
        if n < 0:
            raise KvAllocationError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise KvAllocationError(f"request {req_id} needs {n} blocks, only {len(self._free)} free")
        got = [self._free.pop() for _ in range(n)]
        self._tables.setdefault(req_id, []).extend(got)
        return got

    def free_tail(self, req_id: int, n: int) -> None:
        """Give back the last n blocks of req_id's table, last in first out."""
        table = self._tables.get(req_id, [])
        if n > len(table):
            raise KvAllocationError(f"request {req_id} owns {len(table)} blocks, cannot free {n}")
        for _ in range(n):
            self._free.append(table.pop())

    def free_request(self, req_id: int) -> None:
        table = self._tables.pop(req_id, [])
        self._free.extend(reversed(table))

    def check_integrity(self) -> None:
        """free + used == total, and no block is owned twice or both owned and free."""
        used = [b for t in self._tables.values() for b in t]
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
