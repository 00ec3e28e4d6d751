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
walks the list through ``TierStore``, the one interface every tier's store implements; the rules
that move a block between two tiers live in ``KVCacheManager`` and its collaborators. A store of
blocks a request cannot adopt directly (the disk tier's) implements ``DiskIndex`` too.
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from replicas.kv.block_pool import BlockPool
from replicas.kv.events import Tier
from replicas.kv.hashing import BlockHash
from replicas.kv.records import COPY_PATHS, TierUsage

TIER_ORDER = (Tier.NPU, Tier.HOST, Tier.DISK)
"""Nearest to compute first."""


@runtime_checkable
class TierStore(Protocol):
    """What every tier's store answers (``BlockPool`` for NPU and host, a disk store for disk):
    residency, usage, retention expiry, the hashes it holds and a reset."""

    def contains(self, block_hash: BlockHash) -> bool: ...

    def usage(self) -> TierUsage:
        """Capacity, in use, cached and retained blocks (as of the last expiry; no mutation).
        A shared store counts its own blocks."""
        ...

    def cached_hashes(self) -> list[BlockHash]:
        """The hashes this store holds (its own, for a shared one)."""
        ...

    def expire(self) -> object:
        """Make blocks whose retention ended ordinary again (mutates; the engine thread)."""
        ...

    def reset(self) -> list[BlockHash]:
        """Forget every cached block nobody references; returns the hashes forgotten whose
        removal the caller announces (a store that announces its own changes returns none)."""
        ...


@runtime_checkable
class DiskIndex(TierStore, Protocol):
    """A tier store whose blocks are read into the tier above before use
    (``replicas.kv.disk.DiskStore``): what a read costs, retention by hash, forgetting a block
    that failed to read, and the changes it announces itself."""

    def discard(self, block_hash: BlockHash) -> None: ...

    def read_seconds_per_block(self) -> float: ...

    def retain(self, block_hash: BlockHash, until: float) -> bool:
        """Keep an own block ahead of ordinary ones until ``until``; False if it cannot."""
        ...

    def track_changes(self) -> None:
        """Record own blocks stored and removed from now on (those held already count as
        stored now), for ``drain_changes``."""
        ...

    def drain_changes(self) -> list[tuple[bool, BlockHash]]:
        """(stored, hash) per change since the last call, in order; none until tracked."""
        ...

    def hottest(self) -> list[BlockHash]:
        """Every hash the store can read (every writer's), hottest first by recorded hit
        weight (``replicas.kv.hotness``)."""
        ...

    def set_weight(self, block_hash: BlockHash, weight: float) -> None:
        """Record a new hit weight for an own block (no-op for another writer's)."""
        ...

    @property
    def num_free_slots(self) -> int:
        """Own slots holding nothing."""
        ...

    def room_for(self, weights: list[float]) -> tuple[int, list[BlockHash]]:
        """How many new own blocks of these hit weights (hottest first) fit without replacing
        a hotter block, and the own blocks they replace, coldest first (no mutation)."""
        ...

    def forget(self, block_hash: BlockHash) -> None:
        """Free an own block's slot (no-op for another writer's block)."""
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
    def keeper(self) -> TierStore:
        """The tier's store, whichever kind it is."""
        return self.pool if self.pool is not None else self.store

    @property
    def copy_paths(self) -> list[str]:
        """The ``TransferPlan`` fields that fill this tier."""
        return [field for (_, dst), field in COPY_PATHS.items() if dst == self.tier]

    def holds(self, block_hash: BlockHash) -> bool:
        return self.keeper.contains(block_hash)

    def usage(self) -> TierUsage:
        return self.keeper.usage()

    def expire_retained(self) -> None:
        """End the retentions whose deadline has passed (mutates; the engine thread only)."""
        self.keeper.expire()

    def cached_hashes(self) -> list[BlockHash]:
        return self.keeper.cached_hashes()


def order_tiers(levels: list[TierLevel]) -> list[TierLevel]:
    """``levels`` sorted nearest to compute first; one level per tier, the NPU tier first."""
    ordered = sorted(levels, key=lambda level: TIER_ORDER.index(level.tier))
    tiers = [level.tier for level in ordered]
    if len(set(tiers)) != len(tiers) or not tiers or tiers[0] != Tier.NPU:
        raise ValueError(f"a cache type has one level per tier, the NPU tier first: {tiers}")
    return ordered
