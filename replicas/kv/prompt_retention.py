"""Prompt-cache retention: a request's retained prefix kept ahead of ordinary blocks.

A request whose cache hints retain a prefix (``Request.num_retained_blocks`` blocks, for
``Request.retention_ttl_s`` from now) has each newly cached block of it stored to host if it has
no host copy, and its host block retained (a deadline already later is kept); with backing tiers
(disk), the block is retained there too, once its host copy has landed. Past the tier's
``retained_share``, the rest of the prefix stays ordinary. ``BlockPool`` (retained queue) and the
disk store keep what is retained; this class decides what to retain.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

from replicas.engine.request import Request
from replicas.kv.records import PlannedCopies

if TYPE_CHECKING:
    from replicas.kv.type_manager import CacheTypeManager


class PrefixRetention:
    """Retains requests' prefixes in the host (and backing) tiers of the cache type whose manager
    consults it. Not thread-safe: the manager's engine loop calls it."""

    __slots__ = ("_clock", "_plan")

    def __init__(self, plan: PlannedCopies, clock: Callable[[], float]) -> None:
        self._plan = plan  # the copies planned this step (stores not landed yet)
        self._clock = clock

    def retain(
        self, manager: "CacheTypeManager", request: Request, blocks: list[int | None]
    ) -> None:
        """Retain the request's newly cached blocks of its retained prefix (mutates)."""
        cache_type = manager.cache_type
        rid = request.request_id
        start = cache_type.num_retained.get(rid, 0)
        end = min(request.num_retained_blocks, cache_type.num_cached.get(rid, 0))
        if end <= start:
            return
        until = self._clock() + request.retention_ttl_s
        host = cache_type.host
        # Host blocks whose store from NPU has not landed: their backing copies wait for it
        # (complete_transfer), since a plan's backing stores run before its NPU -> host stores.
        landing = {c.dst for c in self._plan.stores if c.cache_type == cache_type.name}
        for i in range(start, end):
            npu_id = blocks[i] if i < len(blocks) else None
            block_hash = request.block_hashes[i]
            host_id = host.lookup(block_hash)
            if host_id is None and (npu_id is None or host.num_retained >= host.max_retained):
                continue  # nothing to store, or the share is full: it would stay ordinary
            if host_id is None and manager.store(npu_id, block_hash):
                host_id = host.lookup(block_hash)
                landing.add(host_id)
            if host_id is not None and host.retain(host_id, until):
                for writes in manager.backing if host_id not in landing else ():
                    writes.retain(host_id, block_hash, until)
        cache_type.num_retained[rid] = end
