"""The tiers of a cache type as an ordered list, and the by-tier views of plans, matches, usage,
stats and snapshots agree with the named fields they read."""

import pytest

from replicas.kv.block_pool import BlockPool
from replicas.kv.hashing import block_hashes
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import (
    BlockCopy,
    CacheStats,
    CacheTypeMatch,
    CacheTypeUsage,
    DiskCopy,
    TransferPlan,
)
from replicas.kv.events import KVSnapshot, Tier
from replicas.kv.tiers import TierLevel, order_tiers
from replicas.engine.request import Request
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


def test_levels_are_ordered_nearest_to_compute_first_and_checked():
    npu, host = TierLevel(Tier.NPU, BlockPool(4)), TierLevel(Tier.HOST, BlockPool(4))
    disk = TierLevel(Tier.DISK, store=Disk())
    assert [level.tier for level in order_tiers([disk, host, npu])] == list(Tier)
    with pytest.raises(ValueError, match="NPU tier first"):
        order_tiers([host, disk])
    with pytest.raises(ValueError, match="one level per tier"):
        order_tiers([npu, host, host])
    with pytest.raises(ValueError, match="exactly one of"):
        TierLevel(Tier.HOST, BlockPool(2), Disk())
    assert npu.copy_paths == ["loads"] and host.copy_paths == ["stores", "disk_loads"]
    assert disk.copy_paths == ["disk_stores"] and not disk.is_pooled


def test_a_manager_lists_its_tiers_and_matches_through_the_pooled_ones():
    two = KVCacheManager(8, 4, num_host_blocks=8)
    assert [level.tier for level in two._cache_types[0].tiers] == [Tier.NPU, Tier.HOST]
    hashes = block_hashes(list(range(13)), 4)
    three = KVCacheManager(8, 4, num_host_blocks=8, disk={"full": Disk(hashes)})
    (cache_type,) = three._cache_types
    assert [level.tier for level in cache_type.tiers] == list(Tier)
    request = Request("r", list(range(13)), SamplingParams(), 4)
    assert three.match_prefix(request).num_blocks == 0  # disk blocks are never adopted as is
    assert cache_type.anywhere(hashes[0]) and not cache_type.in_pools(hashes[0])
    assert three.onboard(request)  # they are read into host blocks first
    plan = three.take_transfer_plan()
    assert [c.block_hash for c in plan.copies(Tier.DISK, Tier.HOST)] == hashes[:3]
    assert three.usage()["full"].by_tier()[Tier.HOST][1] == 3  # locked for the reads


def test_by_tier_views_read_the_named_fields():
    plan = TransferPlan([BlockCopy(1, 2)], [BlockCopy(3, 4)], (DiskCopy(5, b"s"),), ())
    assert plan.copies(Tier.NPU, Tier.HOST) == plan.stores
    assert plan.copies("host", "npu") == plan.loads
    assert plan.copies(Tier.HOST, Tier.DISK) == plan.disk_stores
    with pytest.raises(KeyError):
        plan.copies(Tier.NPU, Tier.DISK)  # not adjacent
    match = CacheTypeMatch(0, [7, None], [None, 3])
    assert match.block_ids(Tier.NPU) == [7, None] and match.block_ids(Tier.HOST) == [None, 3]
    with pytest.raises(ValueError, match="not"):
        match.block_ids(Tier.DISK)
    usage = CacheTypeUsage(8, 1, 2, 16, 3, 4, 32, 5)
    assert usage.by_tier() == {Tier.NPU: (8, 1, 2), Tier.HOST: (16, 3, 4), Tier.DISK: (32, 0, 5)}
    assert list(CacheTypeUsage(8, 1, 2, 0, 0, 0).by_tier()) == [Tier.NPU]
    stats = CacheStats(npu_hits=10, host_hits=30, disk_hits=12)
    assert stats.hits_by_tier() == {Tier.NPU: 10, Tier.HOST: 18, Tier.DISK: 12}
    snapshot = KVSnapshot(0, 0, (b"n",), (b"h",), (b"sn",), (), (b"d",))
    assert snapshot.hashes(Tier.NPU) == (b"n",) and snapshot.hashes(Tier.DISK) == (b"d",)
    assert snapshot.hashes(Tier.NPU, "sliding") == (b"sn",)
    assert snapshot.hashes(Tier.DISK, "sliding") == ()
