"""The scheduler's side of the prefix cache (kv/prefix_cache.py): looking a prompt up at admission, and
registering every request's full committed blocks after each commit. Mixed into the Scheduler.

Which blocks a request may take: a drafting request only blocks that carry tap features (its drafter context
must cover [0, committed) before it drafts: the hit's rows are handed to the proposer as context whose
features are already in the store, attach_cached); a request that does not draft, any block; a
prompt_logprobs request none (it scores every prompt position). Registered blocks carry features exactly
when their request drafts: every row a drafting request commits is recorded as drafter context.
"""

from __future__ import annotations

from collections.abc import Sequence

from refengine.kv.pool import KvPool
from refengine.request import Request


def token_range(req: Request, a: int, b: int) -> Sequence[int]:
    """The request's token ids (prompt, then output) at positions [a, b)."""
    n = len(req.prompt_ids)
    if b <= n:
        return req.prompt_ids[a:b]
    if a >= n:
        return req.output_ids[a - n : b - n]
    return [*req.prompt_ids[a:], *req.output_ids[: b - n]]


class PrefixSharing:
    # what the Scheduler provides
    pool: KvPool
    _head_keys: tuple[Request, list[bytes]] | None  # the waiting head's prompt keys (it may wait many steps)

    def speculates(self, req: Request) -> bool:
        raise NotImplementedError

    def _lookup(self, req: Request) -> tuple[list[bytes], list[int]]:
        """The prompt's block keys and the cached blocks the request may take (both empty without a cache)."""
        if self.pool.prefix_cache is None:
            return [], []
        memo = self._head_keys
        if memo is None or memo[0] is not req:
            memo = self._head_keys = (req, self.pool.prompt_keys(req.prompt_ids))
        keys = memo[1]
        if req.params.prompt_logprobs:
            return keys, []
        return keys, self.pool.lookup(len(req.prompt_ids), keys, self.speculates(req))

    def _register(self, req: Request) -> None:
        """Register the request's full committed blocks not yet in the cache (after its commit)."""
        length = min(self.pool.seq_len.get(req.request_id, 0), req.num_tokens - 1)
        if self.pool.unregistered(req.request_id, length):
            self.pool.register(
                req.request_id, length, lambda a, b: token_range(req, a, b), has_features=self.speculates(req)
            )
