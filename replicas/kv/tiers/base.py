"""What a tier implements: ``TierStore`` for every tier, ``BackingStore`` for a tier behind
host, ``HandoverStore`` for the one a resize hands blocks over through; and ``TierLevel``, one
tier of one cache type.

A ``TierLevel`` is what a tier is (``Tier``), how many blocks it holds and where they live: a
``BlockPool`` of KV blocks for a *pooled* tier (NPU, host), whose blocks a request adopts; a
backing store for a tier behind host (disk, and any registered since), whose blocks are read
into host blocks before use and written from them::

    tier      blocks live in                  filled by (TransferPlan field)
    npu       BlockPool (device memory)       computed; loads (host -> npu)
    host      BlockPool (host memory)         stores (npu -> host); backing_loads (tier -> host)
    disk ...  a BackingStore (its own)        backing_stores (host -> tier), per copy's tier

What is generic over tiers (residency, usage, reset, snapshots, events) walks a cache type's
levels through ``TierStore``; the rules that move a block between two tiers live in the cache
type's manager and the policies it consults.
"""

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from replicas.kv.block_pool import BlockPool
from replicas.kv.events import Tier, tiers
from replicas.kv.hashing import BlockHash
from replicas.kv.records import TierUsage


@runtime_checkable
class TierStore(Protocol):
    """What every tier's store answers (``BlockPool`` for NPU and host, a backing store
    behind them): residency, usage, retention expiry, the hashes it holds and a reset."""

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
class BackingStore(TierStore, Protocol):
    """One cache type's store of a tier behind host: blocks are written from host blocks and
    read back into them, on the store's own thread. The engine thread calls every method; a
    store announces its own changes (``drain_changes``)."""

    def store(
        self,
        block_hash: BlockHash,
        block: torch.Tensor,
        retained_until: float,
        weight: float,
        batch: bool = False,
    ) -> None:
        """Keep a copy of ``block`` (the caller's to hand over: a clone) under its hash,
        retained until ``retained_until`` when positive, with its hit weight; ``batch``: a
        block of the batch class (``replicas.kv.block_pool``), to replace before the others.
        (A store whose ``store`` takes no ``batch`` is given none.)"""
        ...

    def load_many(
        self, block_hashes: list[BlockHash], outs: list[torch.Tensor]
    ) -> "Future[list[bool]]":
        """Read each block into its host block; per block whether it was valid (a miss is
        False, never a wrong block)."""
        ...

    def discard(self, block_hash: BlockHash) -> None:
        """Forget a block that failed to read."""
        ...

    def read_seconds_per_block(self) -> float:
        """What a read costs now (the cost rule and the adaptive policy weigh it)."""
        ...

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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no bound) for the writes handed over so far;
        whether they all ended."""
        ...

    def close(self) -> None:
        """End the writes in flight and release the store's resources."""
        ...

    def stats(self) -> object:
        """The store's own counters (a NamedTuple), for reports."""
        ...


@runtime_checkable
class HandoverStore(BackingStore, Protocol):
    """A backing store shared by a node's replicas that a resize hands blocks over through
    (``replicas.kv.handover``): ranking by hit weight and room for hotter blocks."""

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
    """One tier of one cache type: ``pool`` for a pooled tier, ``store`` for a backing one."""

    tier: Tier
    pool: BlockPool | None = None
    store: BackingStore | None = None

    def __post_init__(self) -> None:
        self.tier = Tier(self.tier)
        if (self.pool is None) == (self.store is None):
            raise ValueError(f"tier {self.tier}: give exactly one of a block pool and a store")
        if (self.pool is not None) != self.tier.traits.pooled:
            kind = "a block pool" if self.tier.traits.pooled else "a backing store"
            raise ValueError(f"tier {self.tier} is {kind}")

    @property
    def is_pooled(self) -> bool:
        """Whether a request adopts this tier's blocks directly (a block pool), rather than
        after a read into the host tier."""
        return self.pool is not None

    @property
    def keeper(self) -> TierStore:
        """The tier's store, whichever kind it is."""
        return self.pool if self.pool is not None else self.store

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
    """``levels`` sorted nearest to compute first (``tiers()``); one level per tier, the NPU
    tier first, the host tier before any backing tier."""
    order = tiers()
    ordered = sorted(levels, key=lambda level: order.index(level.tier))
    names = [level.tier for level in ordered]
    if len(set(names)) != len(names) or not names or names[0] != Tier.NPU:
        raise ValueError(f"a cache type has one level per tier, the NPU tier first: {names}")
    if any(not level.is_pooled for level in ordered) and Tier.HOST not in names:
        raise ValueError(f"a tier behind host needs the host tier: blocks load through it: {names}")
    return ordered
