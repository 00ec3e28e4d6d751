"""Retention as a priority that decays: a retained host block counts as released at
``r + max(0, u - t)`` (``replicas.kv.free_block_queue``); the pin rule stays selectable; a
session's learned lifetime bounds how long its prefix is retained (exact outcomes on tiny
pools, against a fake clock)."""

import random

import pytest

from replicas.cache_hints import CacheHints
from replicas.config import KVOffloadConfig
from replicas.engine.request import Request
from replicas.kv.block_pool import BlockPool
from replicas.kv.keyed_heap import KeyedHeap
from replicas.kv.manager import KVCacheManager
from replicas.kv.session_gaps import SessionGaps
from replicas.sampling_params import SamplingParams


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def released_at(pool: BlockPool, clock: Clock, block_id: int, seed: int, when: float) -> None:
    """Cache ``seed``'s hash in ``block_id`` (taken already) and release it at ``when``."""
    clock.now = when
    assert pool.cache(block_id, h(seed))
    pool.free([block_id])


def scene(priority: str) -> tuple[BlockPool, Clock, list[int]]:
    """A retained block R (released at 0, retained until 100), an ordinary one released before
    it (at -5) and two after it (at 10 and 40): ids R, O0, O1, O2."""
    clock = Clock(-10.0)
    pool = BlockPool(4, "host", max_retained=1, clock=clock, retained_priority=priority)
    ids, _ = pool.allocate(4)
    retained, o0, o1, o2 = ids
    assert pool.cache(retained, h(0)) and pool.retain(retained, 100.0)
    released_at(pool, clock, o0, 1, -5.0)
    clock.now = 0.0
    pool.free([retained])
    released_at(pool, clock, o1, 2, 10.0)
    released_at(pool, clock, o2, 3, 40.0)
    return pool, clock, ids


def test_a_decaying_retained_block_outlives_fresher_ordinary_blocks_then_yields_to_them():
    pool, clock, (retained, o0, o1, o2) = scene("decay")
    clock.now = 45.0  # counts as released at 0 + 55: after every ordinary block
    assert pool.eviction_order() == [o0, o1, o2, retained]
    clock.now = 70.0  # at 0 + 30: after O1 (10), before O2 (40)
    assert pool.eviction_order() == [o0, o1, retained, o2]
    clock.now = 97.0  # at 0 + 3: before O1, after O0 (-5)
    assert pool.eviction_order() == [o0, retained, o1, o2]
    pool.check_integrity()


def test_at_its_deadline_a_decayed_block_is_ordinary_at_its_true_release_time():
    pool, clock, (retained, o0, o1, o2) = scene("decay")
    clock.now = 100.0
    assert pool.expire() == 1 and pool.num_retained == 0
    assert pool.eviction_order() == [o0, retained, o1, o2]  # not at the back, as pin puts it
    pool.check_integrity()
    _, evicted = pool.allocate(2)
    assert [b for b, _ in evicted] == [o0, retained]
    pool.check_integrity()


def test_allocation_evicts_in_the_order_it_shows():
    pool, clock, (retained, o0, o1, o2) = scene("decay")
    clock.now = 70.0
    order = pool.eviction_order()
    assert pool.next_to_allocate() == order[0]
    _, evicted = pool.allocate(4)
    assert [b for b, _ in evicted] == order == [o0, o1, retained, o2]
    pool.check_integrity()


def test_the_pin_rule_keeps_every_ordinary_block_first_until_the_deadline():
    pool, clock, (retained, o0, o1, o2) = scene("pin")
    clock.now = 97.0
    assert pool.eviction_order() == [o0, o1, o2, retained]
    clock.now = 100.0
    assert pool.expire() == 1
    assert pool.eviction_order() == [o0, o1, o2, retained]  # at the back, as if just released
    pool.check_integrity()


def test_a_later_deadline_moves_a_queued_decaying_block_back():
    pool, clock, (retained, o0, o1, o2) = scene("decay")
    clock.now = 70.0
    assert pool.retain(retained, 170.0)  # a new request asked for its prefix again
    assert pool.eviction_order() == [o0, o1, o2, retained]  # released at 70, counts as 170
    assert pool.num_retained == 1
    pool.check_integrity()


def test_a_retained_block_hit_again_restarts_its_decay_from_its_new_release():
    pool, clock, (retained, o0, o1, o2) = scene("decay")
    clock.now = 60.0
    pool.touch([retained])
    pool.free([retained])  # released at 60, retained until 100: counts as at 60 + 40 - t
    clock.now = 80.0
    assert pool.eviction_order() == [o0, o1, o2, retained]
    pool.check_integrity()


@pytest.mark.parametrize("priority", ["decay", "pin"])
def test_random_operations_keep_the_queues_whole_and_allocation_in_shown_order(priority):
    rng = random.Random(7)
    clock = Clock()
    pool = BlockPool(12, "host", max_retained=5, clock=clock, retained_priority=priority)
    held: list[int] = []
    seeds = iter(range(10**6))
    for _ in range(600):
        clock.now += rng.choice((0.0, 1.0, 7.0))
        op = rng.random()
        if op < 0.3 and pool.num_free:
            pool.expire()
            predicted = pool.eviction_order()[:1]
            (block_id,), _ = pool.allocate(1)
            assert [block_id] == predicted
            pool.cache(block_id, h(next(seeds)))
            held.append(block_id)
        elif op < 0.55 and held:
            pool.free([held.pop(rng.randrange(len(held)))])
        elif op < 0.75:
            cached = [b.block_id for b in pool.blocks if b.block_hash is not None]
            if cached:
                pool.retain(rng.choice(cached), clock.now + rng.choice((5.0, 20.0, 60.0)))
        elif op < 0.85:
            cached = [b.block_id for b in pool.blocks if b.block_hash is not None]
            if cached:
                block_id = rng.choice(cached)
                pool.touch([block_id])
                held.append(block_id)
        elif op < 0.92:
            pool.mark([rng.randrange(12)], batch=rng.random() < 0.5, lifetime_s=10.0)
        else:
            pool.expire()
        pool.check_integrity()
        order = pool.eviction_order()
        assert sorted(order) == sorted(b.block_id for b in pool.blocks if not b.ref_count)


def test_integrity_catches_a_decaying_block_at_the_wrong_key():
    pool, _, (retained, *_) = scene("decay")
    pool.check_integrity()
    pool.blocks[retained].released = 5.0
    with pytest.raises(AssertionError, match="retained heap at another key"):
        pool.check_integrity()


def test_the_keyed_heap_skips_removed_and_rekeyed_ids():
    heap = KeyedHeap()
    for block_id, key in ((1, 5.0), (2, 3.0), (3, 4.0)):
        heap.add(block_id, key)
    heap.add(2, 9.0)  # re-keyed: its old entry is stale
    assert heap.pop(3) == 4.0 and 3 not in heap
    assert list(heap) == [1, 2] and heap.first() == (5.0, 1)
    assert heap.take() == 1 and heap.take() == 2 and len(heap) == 0
    with pytest.raises(IndexError):
        heap.take()


def test_retained_priority_defaults_to_decay_and_a_bad_one_fails_in_one_sentence():
    assert KVOffloadConfig().retained_priority == "decay"
    assert KVOffloadConfig(retained_priority="pin").retained_priority == "pin"
    with pytest.raises(ValueError, match=r"retained_priority must be decay or pin, got 'soft'"):
        KVOffloadConfig(retained_priority="soft")
    with pytest.raises(ValueError, match=r"retained_priority must be one of"):
        KVCacheManager(8, 4, num_host_blocks=8, retained_priority="soft")


@pytest.mark.parametrize("priority", ["decay", "pin"])
def test_the_manager_orders_its_host_pool_by_the_configured_rule(priority):
    manager = KVCacheManager(8, 4, num_host_blocks=8, retained_priority=priority)
    assert manager.host._free_blocks.decay == (priority == "decay")
    assert manager.npu._free_blocks.decay  # nothing is retained there: either rule is LRU


def test_a_session_learns_its_retention_lifetime_after_enough_turns():
    clock = Clock()
    sessions = SessionGaps(300.0, clock=clock)
    assert sessions.learned_s(None) is None
    sessions.turn("s")
    clock.now += 40.0
    sessions.turn("s")
    assert sessions.learned_s("s") is None  # one gap: not enough history
    clock.now += 60.0
    sessions.turn("s")
    assert sessions.learned_s("s") == 1.5 * 60.0
    assert sessions.learned_s("other") is None


def test_a_learned_lifetime_bounds_the_requested_ttl():
    hints = CacheHints(key="s", retain_tokens=8, ttl_s=1800.0)
    assert hints.bounded(None) is hints  # no history: as asked
    assert hints.bounded(90.0) == CacheHints(key="s", retain_tokens=8, ttl_s=90.0)
    assert hints.bounded(3600.0) is hints  # never longer than asked
    tokens = list(range(9))
    request = Request("b", tokens, SamplingParams(), 4, cache_hints=hints.bounded(90.0))
    assert request.retention_ttl_s == 90.0 and request.num_retained_blocks == 2


def test_the_host_tier_retains_a_bounded_prefix_until_its_learned_deadline():
    clock = Clock(1000.0)
    manager = KVCacheManager(
        8,
        4,
        num_host_blocks=8,
        write_through_threshold="immediate",
        retained_share=0.5,
        clock=clock,
    )
    hints = CacheHints(key="s", retain_tokens=8, ttl_s=1800.0)
    asked = Request("q", list(range(50, 59)), SamplingParams(), 4, cache_hints=hints)
    bounded = Request("b", list(range(9)), SamplingParams(), 4, cache_hints=hints.bounded(90.0))
    for request in (bounded, asked):
        match = manager.match_prefix(request)
        assert manager.allocate_slots(request, request.num_tokens, match)
        manager.record_admission(request, match)
        request.num_computed_tokens = request.num_tokens
        manager.cache_blocks(request)
        manager.free(request)
        manager.complete_transfer(manager.take_transfer_plan())
    host = manager.host

    def deadlines(request: Request) -> set[float]:
        return {host.blocks[host.lookup(b)].retained_until for b in request.block_hashes[:2]}

    assert deadlines(bounded) == {1000.0 + 90.0}  # its session's learned lifetime
    assert deadlines(asked) == {1000.0 + 1800.0}  # no history: as asked
    manager.check_integrity()


def test_the_engine_bounds_a_sessions_retention_by_its_learned_lifetime():
    from replicas.config import EngineConfig
    from replicas.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", num_npu_blocks=32))
    clock = Clock()
    engine.sessions._clock = clock
    hints = CacheHints(key="s", retain_tokens=32, ttl_s=1800.0)
    ttls = []
    for i, when in enumerate((0.0, 40.0, 100.0, 160.0)):  # gaps of 40 s, then 60 s
        clock.now = when
        request = engine.add_request(f"t{i}", list(range(1, 40)), cache_hints=hints)
        ttls.append(request.retention_ttl_s)
        engine.abort_request(f"t{i}")
    assert ttls == [1800.0, 1800.0, 90.0, 90.0]  # 1.5 x the longest gap, once two are known
    engine.close()


def test_an_over_quota_tenants_block_whose_retention_ended_is_evicted_in_its_tenants_turn():
    clock = Clock(0.0)
    pool = BlockPool(4, "host", max_retained=1, clock=clock, retained_priority="decay")
    ids, _ = pool.allocate(4)
    expired, other, mine, fresh = ids
    assert pool.cache(expired, h(0), tenant=3) and pool.retain(expired, 50.0)
    pool.free([expired])  # tenant 3's, released at 0, retained until 50
    released_at(pool, clock, other, 1, 10.0)  # tenant 0's (no tenant)
    for block_id, seed, when in ((mine, 2, 20.0), (fresh, 3, 30.0)):
        clock.now = when
        assert pool.cache(block_id, h(seed), tenant=3)
        pool.free([block_id])
    clock.now = 60.0
    assert pool.expire() == 1
    pool.quotas.set({3: 2})  # tenant 3 holds 3 blocks: its own go first, earliest released first
    assert pool.eviction_order() == [expired, mine, fresh, other]
    pool.check_integrity()
    _, evicted = pool.allocate(1)
    assert [b for b, _ in evicted] == [expired] and not pool.quotas.over
    assert pool.eviction_order() == [other, mine, fresh]  # back to one order
    pool.check_integrity()
