"""The tiers of a cache type as an ordered list, and the by-tier views of plans, matches, usage,
stats and snapshots agree with the named fields they read."""

import pytest

from replicas.engine.request import Request
from replicas.kv.block_pool import BlockPool
from replicas.kv.events import KVSnapshot, Tier
from replicas.kv.hashing import block_hashes
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import (
    EMPTY_MATCH,
    BackingCopy,
    BlockCopy,
    CacheStats,
    CacheTypeMatch,
    CacheTypeUsage,
    TierUsage,
    TransferPlan,
    copy_path,
)
from replicas.kv.tiers import BackingStore, TierLevel, TierStore, order_tiers
from replicas.sampling_params import SamplingParams


class Disk:
    """A disk index holding a fixed set of hashes."""

    def __init__(self, hashes=()):
        self.hashes = set(hashes)

    def contains(self, block_hash):
        return block_hash in self.hashes

    def discard(self, block_hash):
        self.hashes.discard(block_hash)

    def read_seconds_per_block(self):
        return 1e-6

    num_retained = 0  # a fixed set: nothing is retained

    def retain(self, block_hash, until):
        return False

    def expire(self):
        pass

    def usage(self):
        return TierUsage(len(self.hashes), 0, len(self.hashes))

    def cached_hashes(self):
        return list(self.hashes)

    def reset(self):
        self.hashes.clear()
        return []

    def track_changes(self):
        pass

    def drain_changes(self):
        return []


def test_levels_are_ordered_nearest_to_compute_first_and_checked():
    npu, host = TierLevel(Tier.NPU, BlockPool(4)), TierLevel(Tier.HOST, BlockPool(4))
    disk = TierLevel(Tier.DISK, store=Disk())
    assert [level.tier for level in order_tiers([disk, host, npu])] == [
        Tier.NPU,
        Tier.HOST,
        Tier.DISK,
    ]
    with pytest.raises(ValueError, match="NPU tier first"):
        order_tiers([host, disk])
    with pytest.raises(ValueError, match="one level per tier"):
        order_tiers([npu, host, host])
    with pytest.raises(ValueError, match="exactly one of"):
        TierLevel(Tier.HOST, BlockPool(2), Disk())
    with pytest.raises(ValueError, match="is a block pool"):
        TierLevel(Tier.HOST, store=Disk())
    with pytest.raises(ValueError, match="needs the host tier"):
        order_tiers([npu, disk])
    assert (copy_path("host", "npu"), copy_path("npu", "host")) == ("loads", "stores")
    assert copy_path("disk", "host") == "backing_loads" and not disk.is_pooled
    assert copy_path(Tier.HOST, Tier.DISK) == "backing_stores"


def test_a_manager_lists_its_tiers_and_matches_through_the_pooled_ones():
    two = KVCacheManager(8, 4, num_host_blocks=8)
    assert [level.tier for level in two._cache_types[0].tiers] == [Tier.NPU, Tier.HOST]
    hashes = block_hashes(list(range(13)), 4)
    three = KVCacheManager(8, 4, num_host_blocks=8, backing={"disk": {"full": Disk(hashes)}})
    (cache_type,) = three._cache_types
    assert [level.tier for level in cache_type.tiers] == [Tier.NPU, Tier.HOST, Tier.DISK]
    request = Request("r", list(range(13)), SamplingParams(), 4)
    assert three.match_prefix(request).num_blocks == 0  # disk blocks are never adopted as is
    assert cache_type.anywhere(hashes[0]) and not cache_type.in_pools(hashes[0])
    assert three.onboarding.onboard(request)  # they are read into host blocks first
    plan = three.take_transfer_plan()
    assert [c.block_hash for c in plan.copies(Tier.DISK, Tier.HOST)] == hashes[:3]
    assert three.views.usage()["full"].by_tier()[Tier.HOST][1] == 3  # locked for the reads


def test_by_tier_views_read_the_named_fields():
    plan = TransferPlan([BlockCopy(1, 2)], [BlockCopy(3, 4)], (BackingCopy(5, b"s"),), ())
    assert plan.copies(Tier.NPU, Tier.HOST) == plan.stores
    assert plan.copies("host", "npu") == plan.loads
    assert plan.copies(Tier.HOST, Tier.DISK) == plan.backing_stores
    with pytest.raises(ValueError, match="no copy path"):
        plan.copies(Tier.NPU, Tier.DISK)  # not adjacent
    match = CacheTypeMatch(0, {Tier.NPU: [7, None], Tier.HOST: [None, 3]})
    assert match.block_ids(Tier.NPU) == [7, None] and match.block_ids(Tier.HOST) == [None, 3]
    assert match.num_blocks_by_source() == {Tier.NPU: 1, Tier.HOST: 1}
    assert CacheTypeMatch(0, {Tier.NPU: [7, 8]}).block_ids(Tier.HOST) == [None, None]
    with pytest.raises(ValueError, match="not"):
        match.block_ids(Tier.DISK)
    tiers = {Tier.NPU: (8, 1, 2), Tier.HOST: (16, 3, 4, 1), Tier.DISK: (32, 0, 5, 2)}
    usage = CacheTypeUsage({tier: TierUsage(*counts) for tier, counts in tiers.items()})
    assert usage.by_tier() == {Tier.NPU: (8, 1, 2), Tier.HOST: (16, 3, 4), Tier.DISK: (32, 0, 5)}
    assert usage.retained_by_tier() == {Tier.HOST: 1, Tier.DISK: 2}
    npu_only = CacheTypeUsage({Tier.NPU: TierUsage(8, 1, 2), Tier.HOST: TierUsage()})
    assert list(npu_only.by_tier()) == [Tier.NPU] and npu_only.of(Tier.DISK) == TierUsage()
    stats = CacheStats(hits_by_source={Tier.NPU: 10, Tier.HOST: 18, Tier.DISK: 12})
    assert stats.hits_by_tier() == {Tier.NPU: 10, Tier.HOST: 18, Tier.DISK: 12}
    assert (stats.npu_hits, stats.host_hits, stats.disk_hits) == (10, 30, 12)
    assert list(CacheStats().hits_by_tier()) == [Tier.NPU, Tier.HOST]  # a deeper tier once used
    stats.count_eviction("full", Tier.HOST)
    assert (stats.npu_evictions, stats.host_evictions) == (0, 1)
    assert stats.by_cache_type["full"].host_evictions == 1
    full = {"npu": (b"n",), "host": (b"h",), "disk": (b"d",)}
    snapshot = KVSnapshot(0, 0, {"full": full, "sliding": {"npu": (b"sn",)}})
    assert snapshot.hashes(Tier.NPU) == (b"n",) and snapshot.hashes(Tier.DISK) == (b"d",)
    assert snapshot.hashes(Tier.NPU, "sliding") == (b"sn",)
    assert snapshot.hashes(Tier.DISK, "sliding") == ()


class AnnouncingDisk:
    """A test-only disk tier, defined here through ``BackingStore`` alone: a bounded LRU of hashes
    that announces its own stores and removals, as ``DiskStore`` does."""

    def __init__(self, num_slots):
        self.num_slots = num_slots
        self.own = {}  # hash -> None, least recently stored first
        self.changes = None

    def store(self, block_hash, block=None, retained_until=0.0, weight=0.0):  # a planned store
        if len(self.own) >= self.num_slots:
            self.discard(next(iter(self.own)))
        self.own[block_hash] = None
        self._note(True, block_hash)

    def contains(self, block_hash):
        return block_hash in self.own

    def discard(self, block_hash):
        if self.own.pop(block_hash, False) is None:
            self._note(False, block_hash)

    def read_seconds_per_block(self):
        return 1e-6

    num_retained = 0

    def retain(self, block_hash, until):
        return False

    def expire(self):
        pass

    def usage(self):
        return TierUsage(self.num_slots, 0, len(self.own))

    def cached_hashes(self):
        return list(self.own)

    def reset(self):
        for block_hash in list(self.own):
            self.discard(block_hash)
        return []  # announced through drain_changes

    def track_changes(self):
        if self.changes is None:
            self.changes = [(True, h) for h in self.own]

    def drain_changes(self):
        if self.changes is None:
            return []
        changes, self.changes = self.changes, []
        return changes

    def _note(self, stored, block_hash):
        if self.changes is not None:
            self.changes.append((stored, block_hash))

    def load_many(self, block_hashes, outs):
        raise AssertionError("the test lands reads itself (land_with_disk)")

    def flush(self, timeout=None):
        return True

    def close(self):
        pass

    def stats(self):
        return ()

    # hotness: none recorded, so the most recently stored count as the hottest
    def hottest(self):
        return list(reversed(self.own))

    def set_weight(self, block_hash, weight):
        pass

    @property
    def num_free_slots(self):
        return self.num_slots - len(self.own)

    def room_for(self, weights):
        return min(len(weights), self.num_free_slots), []

    def forget(self, block_hash):
        self.discard(block_hash)


def land_with_disk(manager, disk):
    """Run a plan as the transfer component would: disk stores, then the rest; reads land."""
    plan = manager.take_transfer_plan()
    for copy in plan.copies(Tier.HOST, Tier.DISK):
        disk.store(copy.block_hash)
    manager.complete_transfer(plan)
    manager.onboarding.complete_loads([(copy, True) for copy in plan.copies(Tier.DISK, Tier.HOST)])
    manager.check_integrity()
    return plan


def test_a_tier_defined_in_a_test_works_with_the_manager_through_the_protocol_alone():
    disk = AnnouncingDisk(num_slots=8)
    assert isinstance(disk, BackingStore) and isinstance(BlockPool(1), TierStore)
    manager = KVCacheManager(
        8,
        4,
        num_host_blocks=4,
        write_through_threshold="immediate",
        backing={"disk": {"full": disk}},
    )
    manager.views.enable_events()
    tokens = list(range(13))  # 3 full blocks + 1 token
    first = Request("a", tokens, SamplingParams(), 4)
    assert manager.allocate_slots(first, first.num_tokens)
    manager.record_admission(first, EMPTY_MATCH)
    first.num_computed_tokens = first.num_tokens
    manager.cache_blocks(first)  # threshold 0: every block to host, then each to disk
    manager.free(first)
    land_with_disk(manager, disk)
    land_with_disk(manager, disk)
    hashes = first.block_hashes[:3]
    assert disk.cached_hashes() == hashes
    disk_events = [e for e in manager.views.drain_events() if e.tier == Tier.DISK]
    assert disk_events == [("stored", "disk", h, "full") for h in hashes]
    manager.reset_prefix_cache(Tier.NPU)
    manager.reset_prefix_cache(Tier.HOST)
    second = Request("b", tokens, SamplingParams(), 4)
    assert manager.match_prefix(second).num_blocks == 0  # on disk only: read into host first
    assert manager.onboarding.onboard(second)
    plan = land_with_disk(manager, disk)
    assert [c.block_hash for c in plan.copies(Tier.DISK, Tier.HOST)] == hashes
    assert not manager.onboarding.onboard(second)  # landed
    match = manager.match_prefix(second)
    assert match.num_blocks_by_tier == {Tier.NPU: 0, Tier.HOST: 3}
    assert manager.views.usage()["full"].of(Tier.DISK) == TierUsage(8, 0, 3)
    assert manager.views.snapshot(0, 0).hashes(Tier.DISK) == tuple(hashes)
    manager.views.drain_events()
    manager.reset_prefix_cache(Tier.DISK)
    assert disk.cached_hashes() == [] and not manager.views.usage()["full"].of(Tier.DISK).num_cached
    assert [e.kind for e in manager.views.drain_events()] == ["removed"] * 3
