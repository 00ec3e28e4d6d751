"""Prefix matching across a manager's cache types: what a request may reuse (no mutation).

The global-attention cache type decides how far a prefix is cached; each sliding cache type
then cuts it to the longest length whose window it holds (the safe prefix); after the whole
blocks, a freed partly computed block may continue the match (``replicas.kv.partial_blocks``).
Reservations, disk onboarding and the manager ask the same matcher, so they agree on a match.

Safe prefix (hybrid): ``L`` leading blocks are reusable only if global KV exists (either tier)
for all ``L`` and sliding KV exists (either tier) for the window ending at the match point::

    block:      0   1   2   3   4   5   6   7 | 8 ...      (L = 8, window spans blocks 6..7)
    full:       *   *   *   *   *   *   *   * |
    sliding:    -   -   -   -   -   -   *   * |            ("-" need not exist)

Sliding blocks that leave a running request's window are released at once (they stay cached).
"""

from replicas.engine.request import Request
from replicas.kv.cache_type import CacheType
from replicas.kv.partial_blocks import PartialBlocks
from replicas.kv.records import EMPTY_MATCH, PrefixMatch


class PrefixMatcher:
    """Matches requests against cache types' tiers (the first is global attention)."""

    __slots__ = ("block_size", "cache_types", "enabled", "partial")

    def __init__(
        self,
        cache_types: list[CacheType],
        block_size: int,
        enabled: bool,
        partial: PartialBlocks | None,
    ) -> None:
        self.cache_types = cache_types
        self.block_size = block_size
        self.enabled = enabled  # prefix caching on
        self.partial = partial  # freed partial blocks to continue a match with, if reused

    def match(self, request: Request, max_blocks: int | None = None) -> PrefixMatch:
        """Longest safe cached prefix, in whole blocks, of at most ``max_blocks``, then (when
        the caller sets no limit) the tokens of a freed partial block that continue it; at
        least the request's last token is always left to compute."""
        if not self.enabled or max_blocks == 0:
            return EMPTY_MATCH
        is_limited = max_blocks is not None  # by the caller (prompt logprobs)
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs
        max_blocks = limit if max_blocks is None else min(max_blocks, limit)
        hashes = request.block_hashes[:max_blocks]
        primary = self.cache_types[0]
        length = 0
        for block_hash in hashes:
            if not primary.in_pools(block_hash):
                break
            length += 1
        for cache_type in self.cache_types[1:]:
            length = cache_type.safe_length(hashes, length, bs)
        matches = {c.name: c.match(hashes, length, bs) for c in self.cache_types}
        match = PrefixMatch(length, matches[primary.name].num_blocks_by_source(), matches)
        if self.partial is None or is_limited:
            return match  # limited by the caller (prompt logprobs): whole blocks only
        start = length * bs
        found = self.partial.find(
            request.parent_key(length),
            request.all_token_ids[start : min(start + bs, request.num_tokens - 1)],
        )
        if found is None:
            return match
        return match._replace(tail=found[0], num_tail_tokens=found[1])

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> dict[str, int]:
        """Free NPU blocks per cache type that allocating ``num_new_tokens`` more tokens after
        adopting ``match`` would consume (no mutation)."""
        num_tokens = request.num_computed_tokens + match.num_tokens(self.block_size)
        total = -(-(num_tokens + num_new_tokens) // self.block_size)
        return {
            c.name: c.num_blocks_needed(request.request_id, total, match.cache_types.get(c.name))
            for c in self.cache_types
        }
