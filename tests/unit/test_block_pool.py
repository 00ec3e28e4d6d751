import pytest

from replicas.kv.block_pool import BlockPool


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_allocate_takes_empty_blocks_before_cached_ones():
    pool = BlockPool(4)
    a, evicted = pool.allocate(2)
    assert a == [0, 1] and evicted == []
    pool.cache(0, h(0))
    pool.cache(1, h(1))
    pool.free([1, 0])  # deepest first
    assert pool.eviction_order() == [2, 3, 1, 0]
    b, evicted = pool.allocate(3)
    assert b == [2, 3, 1]
    assert evicted == [(1, h(1))]
    assert pool.lookup(h(1)) is None and pool.lookup(h(0)) == 0
    pool.check_integrity()


def test_released_request_evicts_deepest_block_first():
    pool = BlockPool(6)
    first, _ = pool.allocate(3)
    for i, block in enumerate(first):
        pool.cache(block, h(i))
    pool.free(list(reversed(first)))
    second, _ = pool.allocate(3)  # empties go first
    assert second == [3, 4, 5]
    _, evicted = pool.allocate(2)
    assert [bh for _, bh in evicted] == [h(2), h(1)]  # depth 2, then 1; the root survives
    assert pool.lookup(h(0)) == 0
    pool.check_integrity()


def test_touch_protects_a_cached_block_and_free_requeues_at_the_back():
    pool = BlockPool(3)
    ids, _ = pool.allocate(3)
    for i in ids:
        pool.cache(i, h(i))
    pool.free([0, 1, 2])
    pool.touch([0])
    assert pool.eviction_order() == [1, 2]
    pool.free([0])
    assert pool.eviction_order() == [1, 2, 0]
    pool.check_integrity()


def test_shared_block_is_freed_only_when_last_reference_drops():
    pool = BlockPool(2)
    (block,), _ = pool.allocate(1)
    pool.cache(block, h(7))
    pool.touch([block])
    pool.free([block])
    assert pool.num_free == 1
    pool.free([block])
    assert pool.num_free == 2
    with pytest.raises(RuntimeError, match="ref_count 0"):
        pool.free([block])


def test_duplicate_hash_is_not_cached_twice():
    pool = BlockPool(2)
    ids, _ = pool.allocate(2)
    assert pool.cache(ids[0], h(1))
    assert not pool.cache(ids[1], h(1))
    assert pool.lookup(h(1)) == ids[0]
    pool.check_integrity()


def test_allocate_beyond_capacity_raises():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_evict_all_cached_keeps_referenced_blocks():
    pool = BlockPool(3)
    ids, _ = pool.allocate(3)
    for i in ids:
        pool.cache(i, h(i))
    pool.free([1, 2])
    evicted = pool.evict_all_cached()
    assert sorted(bh for _, bh in evicted) == [h(1), h(2)]
    assert pool.lookup(h(0)) == 0
    pool.check_integrity()


def test_record_hit_counts_until_the_block_leaves_the_cache():
    pool = BlockPool(2)
    (block,), _ = pool.allocate(1)
    pool.cache(block, h(1))
    assert [pool.record_hit(block) for _ in range(3)] == [1, 2, 3]
    pool.free([block])
    pool.evict_all_cached()
    (again,), _ = pool.allocate(1)  # the emptied block is queued first
    assert again == block
    pool.cache(block, h(2))
    assert pool.record_hit(block) == 1
    pool.check_integrity()


def test_integrity_detects_corruption():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.blocks[0].ref_count = 0  # lost without being queued
    with pytest.raises(AssertionError):
        pool.check_integrity()
