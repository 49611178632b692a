"""The paged KV pool: tensors allocated once, per-request committed lengths, lifetime reservations, the
speculative transaction (schedule_speculative / speculative_view / apply_speculative / revert_schedule) and,
when enabled, the prefix cache's bookkeeping per request (lookup at admission, registering full committed
blocks: kv/prefix_cache.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from refengine.errors import IntegrityError, KvAllocationError
from refengine.kv.allocator import BlockAllocator
from refengine.kv.prefix_cache import ROOT_KEY, PrefixCache


def blocks_for(tokens: int, page: int) -> int:
    return -(-tokens // page)


@dataclass
class SpecReservation:
    """One verify step's reservation, in plan order: req_id -> (start, span, blocks it allocated)."""

    entries: dict[int, tuple[int, int, int]] = field(default_factory=dict)


class KvPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        dummy_blocks: int = 1,
        prefix_caching: bool = False,
    ):
        self.page_size = page_size
        self.prefix_cache = PrefixCache(page_size) if prefix_caching else None
        self.allocator = BlockAllocator(num_blocks, self.prefix_cache)
        # Pages past the allocator's range that no request owns: the padding rows of a graphed step write
        # their K/V there and its padding requests attend to them.
        self.dummy_blocks = list(range(num_blocks, num_blocks + dummy_blocks))
        shape = (num_blocks + dummy_blocks, page_size, num_kv_heads, head_dim)  # NHD pages, as FlashInfer wants
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seq_len: dict[int, int] = {}  # committed KV length per request
        self.lifetime_blocks: dict[int, int] = {}  # blocks promised to each request for its whole life
        # with a prefix cache: keys of each request's full blocks computed so far, and how many of its
        # leading blocks are registered (or came from the cache)
        self._keys: dict[int, list[bytes]] = {}
        self._registered: dict[int, int] = {}

    # ---- admission and plain growth -------------------------------------------------------------------
    @property
    def dummy_slot(self) -> int:
        """The first slot of the first dummy page: where a padding row's K/V (or feature row) goes."""
        return self.dummy_blocks[0] * self.page_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def table(self, req_id: int) -> list[int]:
        """The request's block table (a copy is not made: read only)."""
        return self.allocator.table(req_id)

    def live_requests(self) -> list[int]:
        """Requests admitted and not yet released."""
        return list(self.seq_len)

    def outstanding_promises(self) -> int:
        """Blocks promised to live requests and not yet allocated to them. Every table belongs to a live
        request (check_integrity), so it is the promises' total less the tables' blocks: O(1) in Python where
        the sum over requests' tables made a c32 prefill's admissions O(n^2) (~240 us on the dev CPU)."""
        return sum(self.lifetime_blocks.values()) - self.allocator.table_blocks

    def can_admit(self, lifetime_tokens: int, hit: Sequence[int] = ()) -> bool:
        """Whether the pool can promise a request its lifetime blocks, `hit` (cached blocks it would share)
        counted as already paid; those no table holds yet stop being evictable, so they count against the
        free blocks."""
        need = blocks_for(lifetime_tokens, self.page_size) - len(hit)
        cache = self.prefix_cache
        taken = sum(cache.is_evictable(b) for b in hit) if cache is not None and hit else 0
        return need + taken <= self.allocator.num_free - self.outstanding_promises()

    def admit(self, req_id: int, lifetime_tokens: int, hit: Sequence[int] = (), keys: Sequence[bytes] = ()) -> None:
        """Promise the request its lifetime blocks; with a hit, its table starts with the cached blocks `hit`
        and its committed length with their tokens. `keys`: its prompt's block keys (PrefixCache.keys)."""
        if not self.can_admit(lifetime_tokens, hit):
            raise KvAllocationError(f"request {req_id}: {lifetime_tokens} tokens do not fit the free pool")
        self.lifetime_blocks[req_id] = blocks_for(lifetime_tokens, self.page_size)
        self.seq_len[req_id] = len(hit) * self.page_size
        if self.prefix_cache is not None:
            self.allocator.share(req_id, list(hit))
            self._keys[req_id] = list(keys)
            self._registered[req_id] = len(hit)

    def release(self, req_id: int) -> None:
        self.allocator.free_request(req_id)
        self.seq_len.pop(req_id, None)
        self.lifetime_blocks.pop(req_id, None)
        self._keys.pop(req_id, None)
        self._registered.pop(req_id, None)

    # ---- the prefix cache ---------------------------------------------------------------------------------
    def prompt_keys(self, prompt: Sequence[int]) -> list[bytes]:
        """The keys of the prompt's full blocks (none without a prefix cache)."""
        cache = self.prefix_cache
        return cache.keys(prompt, len(prompt) // self.page_size) if cache is not None else []

    def lookup(self, prompt_len: int, keys: Sequence[bytes], need_features: bool) -> list[int]:
        """The cached blocks of the prompt's longest cached prefix (`keys`: prompt_keys). At least one prompt
        token is left to prefill: its logits give the first output token."""
        cache = self.prefix_cache
        return cache.match(keys[: (prompt_len - 1) // self.page_size], need_features) if cache is not None else []

    def unregistered(self, req_id: int, length: int) -> bool:
        """Whether the request has full blocks within its first `length` tokens not yet registered."""
        return self.prefix_cache is not None and length // self.page_size > self._registered[req_id]

    def register(
        self, req_id: int, length: int, tokens: Callable[[int, int], Sequence[int]], has_features: bool
    ) -> None:
        """Register the request's full blocks within its first `length` (committed) tokens in the prefix
        cache. tokens(a, b): its token ids at positions [a, b)."""
        full, done, page = length // self.page_size, self._registered[req_id], self.page_size
        if self.prefix_cache is None or full <= done:
            return
        keys, table = self._keys[req_id], self.allocator.table(req_id)
        if len(keys) < full:
            parent = keys[-1] if keys else ROOT_KEY
            keys += self.prefix_cache.keys(tokens(len(keys) * page, full * page), full - len(keys), parent, 0)
        for i in range(done, full):
            self.allocator.register(keys[i], table[i], has_features)
        self._registered[req_id] = full

    def _grow(self, req_id: int, new_len: int) -> int:
        need = blocks_for(new_len, self.page_size) - len(self.allocator.table(req_id))
        if need > 0:
            if len(self.allocator.table(req_id)) + need > self.lifetime_blocks[req_id]:
                raise KvAllocationError(f"request {req_id} grows past its lifetime reservation")
            self.allocator.allocate(req_id, need)
        return max(need, 0)

    def extend(self, req_id: int, n: int) -> None:
        """Plain (non-speculative) append of n tokens: prefill or decode."""
        self._grow(req_id, self.seq_len[req_id] + n)
        self.seq_len[req_id] += n

    def truncate(self, req_id: int, length: int) -> None:
        """Undo plain extends (a failed step): the committed length goes back to `length` and blocks past it
        return to the free list, last in first out."""
        cur = self.seq_len[req_id]
        if not 0 <= length <= cur:
            raise KvAllocationError(f"request {req_id}: cannot truncate length {cur} to {length}")
        self.seq_len[req_id] = length
        surplus = len(self.allocator.table(req_id)) - blocks_for(length, self.page_size)
        self.allocator.free_tail(req_id, max(surplus, 0))

    def slot_list(self, req_id: int, start: int, end: int) -> list[int]:
        """slots() as a host list, in plain Python: the few rows of a step (a graph's layout, a draft's context
        rows) cost ~2 us so, against ~20 us for building the tensors (1-1.5 ms of host time a draft step at
        c32). slots() stays for long ranges (a prompt), where tensor arithmetic wins."""
        table, page = self.allocator.table(req_id), self.page_size
        return [table[p // page] * page + p % page for p in range(start, end)]

    def slots(self, req_id: int, start: int, end: int) -> torch.Tensor:
        """Flat slot ids (block * page + offset) of positions [start, end) of a request."""
        table = torch.tensor(self.allocator.table(req_id), dtype=torch.int64)
        pos = torch.arange(start, end)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    # ---- the speculative transaction --------------------------------------------------------------------
    def schedule_speculative(self, spans: dict[int, int]) -> SpecReservation:
        """Reserve slots for each request's whole verify span, for all requests or for none."""
        needs = {
            r: max(blocks_for(self.seq_len[r] + s, self.page_size) - len(self.allocator.table(r)), 0)
            for r, s in spans.items()
        }
        if sum(needs.values()) > self.allocator.num_free:
            raise KvAllocationError(
                f"speculative spans need {sum(needs.values())} blocks, {self.allocator.num_free} free"
            )
        res = SpecReservation()
        for r, s in spans.items():
            res.entries[r] = (self.seq_len[r], s, self._grow(r, self.seq_len[r] + s))
        return res

    def speculative_view(self, res: SpecReservation) -> list[tuple[int, int, int]]:
        """(req_id, start, span) for the verify forward: positions [start, start + span) are writable."""
        return [(r, start, span) for r, (start, span, _) in res.entries.items()]

    def apply_speculative(self, req_id: int, n_commit: int, res: SpecReservation) -> None:
        start, span, _ = res.entries[req_id]
        if not 1 <= n_commit <= span:
            raise KvAllocationError(f"request {req_id}: commit {n_commit} outside 1..span {span}")
        self.seq_len[req_id] = start + n_commit

    def revert_schedule(self, res: SpecReservation) -> None:
        """Drop the unused tail of each reservation, last in first out, freeing blocks it had allocated."""
        for r, (_start, _span, new_blocks) in reversed(res.entries.items()):
            if r not in self.seq_len:
                continue  # released (finished) already: its blocks went back whole
            keep = blocks_for(self.seq_len[r], self.page_size)
            surplus = len(self.allocator.table(r)) - keep
            self.allocator.free_tail(r, min(surplus, new_blocks))

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        tables = set(self.allocator.owners())
        if not tables <= set(self.seq_len):
            raise IntegrityError(f"block tables for requests {sorted(tables - set(self.seq_len))} that were released")
        if set(self.lifetime_blocks) != set(self.seq_len):
            raise IntegrityError(
                f"lifetime promises for requests {sorted(self.lifetime_blocks)}, "
                f"live requests are {sorted(self.seq_len)}"
            )
        for r, n in self.seq_len.items():
            have = len(self.allocator.table(r))
            if have < blocks_for(n, self.page_size):
                raise IntegrityError(f"request {r}: length {n} but only {have} blocks")
            if have > self.lifetime_blocks[r]:
                raise IntegrityError(f"request {r}: {have} blocks over its lifetime promise {self.lifetime_blocks[r]}")
        by_tables = sum(n - len(self.allocator.table(r)) for r, n in self.lifetime_blocks.items())
        if self.outstanding_promises() != by_tables:
            raise IntegrityError(f"outstanding promises {self.outstanding_promises()} != {by_tables} by the tables")
