"""A new request's first lookup, counted: its cached tokens per tier and cache type, on the
request and in the cache's counters."""

from replicas.engine.request import Request
from replicas.kv.events import Tier
from replicas.kv.records import EMPTY_PART, CacheStats, PrefixMatch


def count_admission(
    stats: CacheStats,
    request: Request,
    match: PrefixMatch,
    block_size: int,
    primary: str,
    prefetched: dict[str, set[int]],
    read: dict[tuple[str, int], str],
) -> None:
    """A new request's cached tokens per tier and cache type, on the request and in ``stats``:
    a block its reservation ``prefetched`` counts as the host hit it was, and the host blocks
    its reads filled (``read``: (cache type, host block) -> the backing tier read from) as hits
    of that tier too."""
    bs = block_size
    primary_npu = match.cache_types.get(primary, EMPTY_PART).block_ids(Tier.NPU)
    loaded = prefetched.get(primary, ())
    num_prefetched = sum(1 for b in primary_npu if b is not None and b in loaded)
    request.num_npu_cached_tokens = (match.num_blocks_in(Tier.NPU) - num_prefetched) * bs
    request.num_npu_cached_tokens += match.num_tail_tokens
    request.num_host_cached_tokens = (match.num_blocks_in(Tier.HOST) + num_prefetched) * bs
    request.num_cached_tokens = request.num_npu_cached_tokens + request.num_host_cached_tokens
    for name, part in match.cache_types.items():
        loaded = prefetched.get(name, ())
        npu_ids = part.block_ids(Tier.NPU)
        num_npu = sum(1 for b in npu_ids if b is not None and b not in loaded)
        num_host = len(npu_ids) - num_npu
        num_tail = match.num_tail_tokens if name == primary else 0
        request.cached_tokens_by_cache_type[name] = (num_npu * bs + num_tail, num_host * bs)
    from_backing: dict[str, int] = {}
    if read:
        part = match.cache_types.get(primary, EMPTY_PART)
        for n, h in zip(part.block_ids(Tier.NPU), part.block_ids(Tier.HOST)):
            tier = read.get((primary, h)) if n is None else None
            if tier is not None:
                from_backing[tier] = from_backing.get(tier, 0) + 1
    stats.queries += request.num_prompt_tokens
    stats.hits += request.num_cached_tokens
    stats.count_hits(Tier.NPU, request.num_npu_cached_tokens)
    num_backing = sum(from_backing.values())
    stats.count_hits(Tier.HOST, request.num_host_cached_tokens - num_backing * bs)
    for tier, num_blocks in from_backing.items():
        stats.count_hits(Tier(tier), num_blocks * bs)
