"""The tiers of one cache type, as an ordered list: NPU, then host, then disk.

A ``TierLevel`` is one tier of one cache type: what it is (``Tier``), how many blocks it holds,
where they live (a ``BlockPool`` of KV blocks for the NPU and host tiers; a disk store of files,
behind an index, for the disk tier) and its copy path (the transfer plan's copies that fill it
from the tier above and below)::

    level   tier   blocks live in               filled by (TransferPlan field)
    0       npu    BlockPool (device memory)    computed; loads (host -> npu)
    1       host   BlockPool (host memory)      stores (npu -> host); disk_loads (disk -> host)
    2       disk   DiskStore (files, shared)    disk_stores (host -> disk)

A block is reusable at once from the NPU tier, after one load from host, after a read into host
and a load from disk. What is generic over tiers (residency, usage, reset, snapshots, integrity)
walks the list; the rules that move a block between two tiers live in ``KVCacheManager``.
"""

from dataclasses import dataclass
from typing import Protocol

from replicas.kv.block_pool import BlockPool
from replicas.kv.hashing import BlockHash
from replicas.kv.records import COPY_PATHS
from replicas.kv.events import Tier

TIER_ORDER = (Tier.NPU, Tier.HOST, Tier.DISK)
"""Nearest to compute first."""


class DiskIndex(Protocol):
    """What the manager asks of a disk store (``replicas.kv.disk.DiskStore``): which blocks it
    holds, what a read costs, and to forget a block that failed to read."""

    def contains(self, block_hash: BlockHash) -> bool: ...

    def discard(self, block_hash: BlockHash) -> None: ...

    def read_seconds_per_block(self) -> float: ...

    def retain(self, block_hash: BlockHash, until: float) -> bool:
        """Keep an own block ahead of ordinary ones until ``until``; False if it cannot."""
        ...

    def expire(self) -> None:
        """Make own blocks whose retention ended ordinary again."""
        ...

    @property
    def num_retained(self) -> int:
        """Own blocks retained now."""
        ...


@dataclass(slots=True)
class TierLevel:
    """One tier of one cache type: exactly one of ``pool`` (NPU, host) and ``store`` (disk)."""

    tier: Tier
    pool: BlockPool | None = None
    store: DiskIndex | None = None

    def __post_init__(self) -> None:
        if (self.pool is None) == (self.store is None):
            raise ValueError(f"tier {self.tier}: give exactly one of a block pool and a store")

    @property
    def is_pooled(self) -> bool:
        """Whether a request adopts this tier's blocks directly (a block pool), rather than
        after a read into the tier above."""
        return self.pool is not None

    @property
    def copy_paths(self) -> list[str]:
        """The ``TransferPlan`` fields that fill this tier."""
        return [field for (_, dst), field in COPY_PATHS.items() if dst == self.tier]

    def holds(self, block_hash: BlockHash) -> bool:
        if self.pool is not None:
            return self.pool.lookup(block_hash) is not None
        return self.store.contains(block_hash)

    def counts(self) -> tuple[int, int, int]:
        """(capacity, in use, cached) in blocks; a disk store's are its own slots."""
        if self.pool is not None:
            return self.pool.num_blocks, self.pool.num_used, self.pool.num_cached
        stats = getattr(self.store, "stats", None)
        if stats is None:
            return 0, 0, 0
        disk = stats()
        return disk.num_slots, 0, disk.num_cached

    def num_retained(self) -> int:
        """Blocks kept ahead of ordinary ones, as of the tier's last expiry (no mutation: the
        engine thread expires them, ``KVCacheManager.expire_retained``)."""
        keeper = self.pool if self.pool is not None else self.store
        return keeper.num_retained

    def expire_retained(self) -> None:
        """End the retentions whose deadline has passed (mutates; the engine thread only)."""
        keeper = self.pool if self.pool is not None else self.store
        keeper.expire()

    def cached_hashes(self) -> list[BlockHash]:
        if self.pool is not None:
            return self.pool.cached_hashes()
        own_keys = getattr(self.store, "own_keys", None)
        return own_keys() if own_keys is not None else []


def order_tiers(levels: list[TierLevel]) -> list[TierLevel]:
    """``levels`` sorted nearest to compute first; one level per tier, the NPU tier first."""
    ordered = sorted(levels, key=lambda level: TIER_ORDER.index(level.tier))
    tiers = [level.tier for level in ordered]
    if len(set(tiers)) != len(tiers) or not tiers or tiers[0] != Tier.NPU:
        raise ValueError(f"a cache type has one level per tier, the NPU tier first: {tiers}")
    return ordered
