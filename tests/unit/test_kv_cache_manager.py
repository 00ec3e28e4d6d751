"""Exact outcomes of the tiered cache policies on tiny pools (no tensors)."""

import itertools

import pytest

from replicas.engine.request import Request
from replicas.kv.events import KVEventKind, KVSnapshot, Tier
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import CacheTypeUsage, TierUsage
from replicas.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_request(tokens: list[int]) -> Request:
    return Request(f"r{next(_ids)}", tokens, SamplingParams(), BS)


def run(manager: KVCacheManager, tokens: list[int], *, finish: bool = True) -> Request:
    """Admit a request, 'compute' its whole prompt, optionally finish it."""
    request = make_request(tokens)
    match = manager.match_prefix(request)
    num_computed = match.num_blocks * BS
    assert manager.allocate_slots(request, request.num_tokens - num_computed, match)
    manager.record_admission(request, match)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    if finish:
        manager.free(request)
    manager.check_integrity()
    return request


def land(manager: KVCacheManager):
    plan = manager.take_transfer_plan()
    manager.complete_transfer(plan)
    manager.check_integrity()
    return plan


PROMPT = list(range(13))  # 3 full blocks + 1 token


def test_match_leaves_the_last_token_to_compute():
    manager = KVCacheManager(8, BS)
    run(manager, list(range(12)))
    again = make_request(list(range(12)))
    assert manager.match_prefix(again).num_blocks == 2  # not 3: the last token is computed
    longer = make_request(list(range(13)))
    assert manager.match_prefix(longer).num_blocks == 3


def test_hits_and_queries_count_tokens():
    manager = KVCacheManager(8, BS)
    first = run(manager, PROMPT)
    second = run(manager, PROMPT)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12 and second.num_npu_cached_tokens == 12
    assert manager.stats.queries == 26 and manager.stats.hits == 12


def test_prefix_caching_off_never_matches():
    manager = KVCacheManager(8, BS, enable_prefix_caching=False)
    run(manager, PROMPT)
    assert run(manager, PROMPT).num_cached_tokens == 0
    assert manager.npu.num_cached == 0


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_promotion_happens_on_exactly_the_threshold_th_later_hit(threshold):
    manager = KVCacheManager(8, BS, num_host_blocks=8, write_through_threshold=threshold)
    run(manager, PROMPT)  # the initial write is not a hit
    assert not land(manager)
    for _ in range(threshold - 1):
        run(manager, PROMPT)
        assert not land(manager)
    run(manager, PROMPT)
    plan = land(manager)
    assert len(plan.stores) == 3 and not plan.loads
    assert manager.stats.write_through_promotions == 3
    run(manager, PROMPT)  # already on host: never stored again
    assert not land(manager)


def test_promotion_disabled_never_stores():
    manager = KVCacheManager(8, BS, num_host_blocks=8, write_through_threshold=0)
    for _ in range(5):
        run(manager, PROMPT)
        assert not land(manager)
    assert manager.stats.write_through_promotions == 0


def test_immediate_promotion_stores_at_first_write():
    manager = KVCacheManager(8, BS, num_host_blocks=8, write_through_threshold="immediate")
    request = run(manager, PROMPT, finish=False)
    plan = land(manager)
    blocks = manager.block_ids(request.request_id)
    assert [c.src for c in plan.stores] == blocks[:3]
    assert manager.host.num_cached == 3


def test_write_back_stores_only_npu_only_blocks_and_only_on_eviction():
    manager = KVCacheManager(4, BS, num_host_blocks=8, write_through_threshold=0, write_back=True)
    a = list(range(100, 108))  # two full blocks
    run(manager, a + [1])  # 3 NPU blocks, 2 cached
    assert not land(manager)  # nothing stored without eviction
    b = list(range(200, 212))
    run(manager, b + [1])  # needs 4 blocks: evicts a's two cached blocks
    plan = land(manager)
    assert len(plan.stores) == 2 and manager.stats.write_backs == 2
    assert manager.match_prefix(make_request(a + [1])).num_blocks_in(Tier.HOST) == 2


def test_write_back_skips_blocks_already_on_host():
    manager = KVCacheManager(4, BS, num_host_blocks=8, write_through_threshold=1, write_back=True)
    a = list(range(100, 108))
    run(manager, a + [1])
    run(manager, a + [2])  # first later hit: promoted by write-through
    assert len(land(manager).stores) == 2
    run(manager, list(range(200, 212)) + [1])  # evicts a's blocks, already on host
    assert not land(manager).stores
    assert manager.stats.write_backs == 0


def test_host_hit_reloads_and_reports_host_tokens():
    manager = KVCacheManager(4, BS, num_host_blocks=8, write_through_threshold=1)
    a = list(range(100, 108))
    run(manager, a + [1])
    run(manager, a + [2])
    land(manager)
    run(manager, list(range(200, 212)) + [1])  # evict a from NPU
    land(manager)
    request = run(manager, a + [3], finish=False)
    plan = land(manager)
    assert request.num_host_cached_tokens == 8 and request.num_npu_cached_tokens == 0
    assert [c.dst for c in plan.loads] == manager.block_ids(request.request_id)[:2]
    assert manager.stats.host_hits == 8
    # Reloaded blocks are NPU-resident again, and keep their host copy.
    assert manager.npu.lookup(request.block_hashes[0]) is not None
    assert manager.host.lookup(request.block_hashes[0]) is not None


def test_match_interleaves_npu_and_host_blocks():
    manager = KVCacheManager(8, BS, num_host_blocks=8, write_through_threshold="immediate")
    request = run(manager, list(range(12)) + [1])
    land(manager)
    # Drop block 1 from the NPU tier only.
    victim = manager.npu.lookup(request.block_hashes[1])
    manager.npu.touch([victim])
    manager.npu._uncache(manager.npu.blocks[victim])
    manager.npu.free([victim])
    match = manager.match_prefix(make_request(list(range(12)) + [2]))
    assert match.num_blocks_by_tier == {Tier.NPU: 2, Tier.HOST: 1}
    part = match.cache_types["full"]
    assert part.block_ids(Tier.NPU)[1] is None and part.block_ids(Tier.HOST)[1] is not None


def test_host_lru_evicts_least_recently_stored_first():
    manager = KVCacheManager(8, BS, num_host_blocks=2, write_through_threshold="immediate")
    first = run(manager, [1, 1, 1, 1, 0])
    second = run(manager, [2, 2, 2, 2, 0])
    land(manager)
    third = run(manager, [3, 3, 3, 3, 0])
    land(manager)
    assert manager.host.lookup(first.block_hashes[0]) is None
    assert manager.host.lookup(second.block_hashes[0]) is not None
    assert manager.host.lookup(third.block_hashes[0]) is not None
    assert manager.stats.host_evictions == 1


def test_in_flight_host_blocks_are_never_evicted():
    manager = KVCacheManager(8, BS, num_host_blocks=1, write_through_threshold="immediate")
    first = run(manager, [1, 1, 1, 1, 0])
    # The store has not landed: its host block is locked, so the next store finds no room.
    second = run(manager, [2, 2, 2, 2, 0])
    plan = land(manager)
    assert len(plan.stores) == 1
    assert manager.host.lookup(first.block_hashes[0]) is not None
    assert manager.host.lookup(second.block_hashes[0]) is None
    assert manager.stats.write_through_promotions == 1


def test_allocation_fails_without_changing_anything():
    manager = KVCacheManager(2, BS)
    held = run(manager, list(range(8)), finish=False)  # 2 blocks + 0 spare... 8 tokens = 2
    request = make_request(list(range(50, 55)))
    assert not manager.allocate_slots(request, 5)
    assert manager.block_ids(request.request_id) == []
    manager.free(held)
    manager.check_integrity()


def test_reset_prefix_cache_per_tier():
    manager = KVCacheManager(8, BS, num_host_blocks=8, write_through_threshold="immediate")
    run(manager, PROMPT)
    land(manager)
    manager.reset_prefix_cache("npu")
    assert manager.npu.num_cached == 0 and manager.host.num_cached == 3
    assert run(manager, PROMPT).num_host_cached_tokens == 12
    land(manager)
    manager.reset_prefix_cache("all")
    assert manager.npu.num_cached == 0 and manager.host.num_cached == 0
    with pytest.raises(ValueError, match="tier"):
        manager.reset_prefix_cache("tape")


def test_events_snapshot_and_usage_follow_the_pools():
    manager = KVCacheManager(8, BS, num_host_blocks=4, write_through_threshold="immediate")
    first = run(manager, PROMPT)
    land(manager)
    assert manager.views.drain_events() == []  # recording is off until enabled
    manager.views.enable_events()
    manager.reset_prefix_cache(Tier.NPU)
    hashes = first.block_hashes[:3]
    # Deepest first, as the request released them; plain strings compare equal to the enums.
    assert manager.views.drain_events() == [("removed", "npu", h, "full") for h in reversed(hashes)]
    assert manager.views.snapshot(2, 5) == KVSnapshot(
        2, 5, {"full": {"npu": (), "host": tuple(hashes)}}
    )
    npu_and_host = {Tier.NPU: TierUsage(8, 0, 0), Tier.HOST: TierUsage(4, 0, 3)}
    assert manager.views.usage() == {"full": CacheTypeUsage(npu_and_host)}
    request = run(manager, PROMPT, finish=False)  # reloads all 3 blocks from host
    assert [(e.kind, e.tier) for e in manager.views.drain_events()] == [
        (KVEventKind.STORED, Tier.NPU)
    ] * 3
    locked = {Tier.NPU: TierUsage(8, 4, 3), Tier.HOST: TierUsage(4, 3, 3)}  # loads lock host blocks
    assert manager.views.usage()["full"] == CacheTypeUsage(locked)
    assert manager.num_free_npu_blocks() == {"full": 4}
    land(manager)
    assert manager.views.usage()["full"].of(Tier.HOST).num_used == 0
    assert manager.stats.blocks_loaded == manager.stats.by_cache_type["full"].blocks_loaded == 3
    manager.free(request)
    assert manager.views.snapshot(0, 9) == KVSnapshot(
        0, 9, {"full": dict.fromkeys(("npu", "host"), tuple(hashes))}
    )
