from refengine.kv.allocator import BlockAllocator
from refengine.kv.pool import KvPool, SpecReservation

__all__ = ["BlockAllocator", "KvPool", "SpecReservation"]
