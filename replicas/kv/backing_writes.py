"""When one cache type's host blocks are stored to a backing tier (disk, or any registered
behind host): the rules its manager consults, one ``BackingWrites`` per backing tier.

Blocks leave host for a backing tier by the rules that move them from NPU to host: a host block
whose hits reach ``write_through_threshold`` is stored, every host block under ``immediate``;
with write-back, a host-only block that host eviction takes is stored first, and with the
adaptive policy when ``RetentionTracker.should_store_to_disk`` says so (the policy's name for
any tier behind host). A retained block is retained there too. A store locks its host block
until the copy has read it (``store_landed``).
"""

from typing import NamedTuple

from replicas.kv.cache_type import CacheType
from replicas.kv.hashing import BlockHash
from replicas.kv.hotness import HitWeights
from replicas.kv.journal import Journal
from replicas.kv.records import BackingCopy
from replicas.kv.retention import IMMEDIATE, WriteThrough, hit_threshold


class BackingRules(NamedTuple):
    """When host blocks go to a backing tier: the write-through threshold, write-back, and
    whether the adaptive policy decides at host eviction."""

    write_through_threshold: WriteThrough
    write_back: bool
    adaptive: bool


class BackingWrites:
    """The host -> ``tier`` rules of one cache type. Not thread-safe: the manager's engine loop
    calls it."""

    __slots__ = ("_cache_type", "_journal", "_rules", "_store", "_weights", "tier")

    def __init__(
        self,
        cache_type: CacheType,
        tier: str,
        journal: Journal,
        rules: BackingRules,
        weights: HitWeights,
    ) -> None:
        """``weights``: the blocks' hit weights, which the tier's store records with each."""
        self._cache_type = cache_type
        self.tier = tier
        self._store = cache_type.store_of(tier)
        self._journal = journal
        self._rules = rules
        self._weights = weights

    def count_host_hit(self, host_id: int, num_hits: int) -> None:
        """A new request reloads a host block (``num_hits``, counted by the manager): at the
        threshold, it is stored to this tier too."""
        host = self._cache_type.host
        threshold = hit_threshold(self._rules.write_through_threshold)
        if threshold is not None and num_hits >= threshold:
            self.store(host_id, host.blocks[host_id].block_hash)

    def store(self, host_id: int, block_hash: BlockHash, retained_until: float = 0.0) -> None:
        """Plan a copy of a host block to this tier, unless it holds it; the host block stays
        locked until the copy has read it (``store_landed``). A retained block is kept there
        until ``retained_until``."""
        cache_type = self._cache_type
        if block_hash is None or self._store.contains(block_hash):
            return
        cache_type.host.touch([host_id])
        weight = self._weight(host_id, block_hash)
        block = cache_type.host.blocks[host_id]
        copy = BackingCopy(
            host_id,
            block_hash,
            cache_type.name,
            True,
            retained_until,
            weight,
            self.tier,
            block.batch,
            block.tenant,
        )
        self._journal.plan.backing_stores.append(copy)

    def retain(self, host_id: int, block_hash: BlockHash, until: float) -> None:
        """Retain a block in this tier too: its own copy, else a new one from its (landed)
        host block. A block another replica wrote stays that replica's to keep."""
        if self._store.contains(block_hash):
            self._store.retain(block_hash, until)
        else:
            self.store(host_id, block_hash, until)

    def before_host_eviction(self) -> None:
        """Before host allocation evicts its next block, store that block to this tier: always
        with write-back, as the adaptive policy decides with it, never else. The copy runs
        first in the plan, so it reads the block before this plan's store overwrites it."""
        if not (self._rules.write_back or self._rules.adaptive):
            return
        cache_type = self._cache_type
        host = cache_type.host
        host.expire()  # as allocation will: the block it takes next
        host_id = host.next_to_allocate()
        block = host.blocks[host_id] if host_id is not None else None
        block_hash = block.block_hash if block is not None else None
        if block_hash is None or self._store.contains(block_hash):
            return
        if not self._rules.write_back:
            read_s = self._store.read_seconds_per_block()
            if not cache_type.retention.should_store_to_disk(read_s):
                self._journal.stats.tier(self.tier).write_back_skips += 1
                return
        weight = self._weight(host_id, block_hash)
        copy = BackingCopy(
            host_id,
            block_hash,
            cache_type.name,
            locked=False,
            weight=weight,
            tier=self.tier,
            batch=block.batch,
            tenant=block.tenant,
        )
        self._journal.plan.backing_stores.append(copy)

    def _weight(self, host_id: int, block_hash: BlockHash) -> float:
        """The hit weight the tier ranks the block by: none for a batch block (``BlockPool.mark``),
        so that a hand-over or a warm start takes it last."""
        if self._cache_type.host.blocks[host_id].batch:
            return 0.0
        return self._weights.weight(block_hash)

    def host_store_landed(self, host_id: int) -> None:
        """An NPU -> host store landed: a retained block is retained in this tier too; under
        ``immediate`` every host block is stored to this tier."""
        host_block = self._cache_type.host.blocks[host_id]
        if host_block.retained_until:
            self.retain(host_id, host_block.block_hash, host_block.retained_until)
        elif self._rules.write_through_threshold == IMMEDIATE:
            self.store(host_id, host_block.block_hash)

    def store_landed(self, copy: BackingCopy) -> None:
        """A host -> tier copy has read its host block: unlock it."""
        self._journal.stats.tier(self.tier).blocks_stored += 1
        if copy.locked:
            self._cache_type.host.free([copy.host_id])
