"""What a replica and its router read of the KV cache: events, snapshots, usage, retention.

``EventLog`` records the stored/removed events the manager and its collaborators emit (once a
replica that reports to a router turns them on); ``CacheViews`` answers the read-only questions
(usage per tier, the retention trackers' stats, the snapshot a router resyncs from) and drains
the events, the backing tiers' own changes after the others. Neither mutates a pool.
"""

from typing import Any

from replicas.kv.cache_type import CacheType
from replicas.kv.events import KVEvent, KVEventKind, KVSnapshot, Tier
from replicas.kv.hashing import BlockHash
from replicas.kv.records import CacheTypeUsage
from replicas.kv.retention import RetentionStats
from replicas.kv.tenants import backing_tenants


class EventLog:
    """The KV events since the last drain, in order; off until ``enable``."""

    __slots__ = ("_events", "enabled")

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[KVEvent] = []

    def emit(self, cache_type: str, kind: KVEventKind, tier: Tier, block_hash: BlockHash) -> None:
        if self.enabled:
            self._events.append(KVEvent(kind, tier, block_hash, cache_type))

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


class CacheViews:
    """The replica's and the router's views of a manager's cache types (no mutation but the
    event drain)."""

    __slots__ = ("_block_size", "_cache_types", "events")

    def __init__(self, cache_types: list[CacheType], block_size: int, events: EventLog) -> None:
        self._cache_types = cache_types
        self._block_size = block_size
        self.events = events

    def usage(self) -> dict[str, CacheTypeUsage]:
        """Blocks per cache type and tier, the primary cache type first."""
        return {c.name: c.usage() for c in self._cache_types}

    def tenant_holders(self) -> dict[str, Any]:
        """What holds the primary cache type's blocks per tenant, by tier: its pools and the
        backing stores that keep tenants (each with ``quotas``, a ``TenantQuotas``)."""
        primary = self._cache_types[0]
        return {"npu": primary.npu, "host": primary.host, **backing_tenants(primary)}

    def retention_stats(self) -> dict[str, RetentionStats]:
        """Ghost records, miss-ratio curve and adaptive decisions per cache type (empty without
        a host tier)."""
        return {
            c.name: c.retention.snapshot(self._block_size)
            for c in self._cache_types
            if c.retention is not None
        }

    def retention_policy(self) -> str | None:
        """The host tier's retention policy, by its point on the miss-ratio curve
        (``RetentionPolicy.curve_name``); None without a host tier."""
        tracker = self._cache_types[0].retention
        return tracker.policy.curve_name if tracker is not None else None

    def enable_events(self) -> None:
        """Record KV events from now on; the blocks a backing tier holds from before (a disk
        tier after a restart) are announced first."""
        self.events.enabled = True
        for cache_type in self._cache_types:
            for level in cache_type.backing:
                level.store.track_changes()

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last call, in order (mutates); the backing tiers'
        follow (their writes land in the background, so their order among the others does not
        matter)."""
        events = self.events.drain()
        for cache_type in self._cache_types if self.events.enabled else ():
            for level in cache_type.backing:
                for stored, block_hash in level.store.drain_changes():
                    kind = KVEventKind.STORED if stored else KVEventKind.REMOVED
                    events.append(KVEvent(kind, level.tier, block_hash, cache_type.name))
        return events

    def locate(self, cache_type: str, block_hash: BlockHash) -> tuple[Tier, int] | None:
        """Where a cache type holds a block in a pooled tier, nearest first: (tier, block id),
        or None (no mutation)."""
        found = next(c for c in self._cache_types if c.name == cache_type)
        for tier, pool in zip(found.pooled_tiers, found.pools):
            block_id = pool.lookup(block_hash)
            if block_id is not None:
                return tier, block_id
        return None

    def snapshot(self, replica_index: int, next_seq: int) -> KVSnapshot:
        """Every hash each cache type holds, per tier, in the message a router resyncs from;
        ``next_seq`` is the sequence number of the replica's next event, so the caller drains
        and publishes pending events first."""
        by_tier = {
            c.name: {level.tier: tuple(level.cached_hashes()) for level in c.tiers}
            for c in self._cache_types
        }
        return KVSnapshot(replica_index, next_seq, by_tier)
