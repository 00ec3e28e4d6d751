"""Prompt-cache retention: a retained prefix outlives ordinary blocks in the host and disk tiers
for its lifetime, within the tier's retained share (exact outcomes on tiny pools), under either
rule of the host tier (``retained_priority``: decay or pin; the decay rule's own outcomes are in
``test_retention_decay``)."""

import itertools

import pytest
import torch

from cluster.cli import build_config, build_parser, main
from replicas.cache_hints import CacheHints
from replicas.config import KVOffloadConfig
from replicas.engine.request import Request
from replicas.kv.block_pool import BlockPool
from replicas.kv.disk import DiskStore
from replicas.kv.events import Tier
from replicas.kv.manager import KVCacheManager
from replicas.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(manager: KVCacheManager, tokens: list[int], hints: CacheHints | None = None) -> Request:
    """Admit a request, compute its prompt, finish it and land its transfers."""
    request = Request(f"r{next(_ids)}", tokens, SamplingParams(), BS, cache_hints=hints)
    match = manager.match_prefix(request)
    assert manager.allocate_slots(request, request.num_tokens - match.num_blocks * BS, match)
    manager.record_admission(request, match)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    manager.free(request)
    manager.complete_transfer(manager.take_transfer_plan())
    manager.check_integrity()
    return request


def prompt(seed: int) -> list[int]:
    """3 full blocks and one more token, unique per seed."""
    return [seed * 100 + i for i in range(13)]


def on_host(manager: KVCacheManager, request: Request) -> list[bool]:
    return [manager.host.lookup(h) is not None for h in request.block_hashes[:3]]


RETAIN = CacheHints(retain_tokens=13, ttl_s=60.0)


def make_manager(clock: Clock, **kwargs) -> KVCacheManager:
    options = {"write_through_threshold": "immediate", "retained_share": 0.5} | kwargs
    return KVCacheManager(8, BS, num_host_blocks=8, clock=clock, **options)


@pytest.mark.parametrize("priority", ["decay", "pin"])
def test_a_retained_prefix_survives_host_churn_that_evicts_an_ordinary_one(priority):
    clock = Clock()
    manager = make_manager(clock, retained_priority=priority)
    retained = run(manager, prompt(1), RETAIN)
    ordinary = run(manager, prompt(2))
    assert manager.host.num_retained == 3
    assert manager.views.usage()["full"].of(Tier.HOST).num_retained == 3
    for seed in range(10, 14):  # 12 new host blocks through the 5 ordinary ones
        run(manager, prompt(seed))
    assert on_host(manager, retained) == [True, True, True]
    assert on_host(manager, ordinary) == [False, False, False]
    # The ordinary blocks went first: the retained ones wait at the end of eviction order.
    retained_ids = {manager.host.lookup(h) for h in retained.block_hashes[:3]}
    assert set(manager.host.eviction_order()[-3:]) == retained_ids


@pytest.mark.parametrize("priority", ["decay", "pin"])
def test_expiry_returns_the_prefix_to_ordinary_order(priority):
    clock = Clock()
    manager = make_manager(clock, retained_priority=priority)
    retained = run(manager, prompt(1), RETAIN)
    clock.now += 59.0
    run(manager, prompt(10))
    assert manager.host.num_retained == 3  # not yet
    clock.now += 2.0
    assert (
        manager.views.usage()["full"].of(Tier.HOST).num_retained == 3
    )  # counted as of the last expiry
    manager.expire_retained()  # once per engine step
    assert manager.views.usage()["full"].of(Tier.HOST).num_retained == 0
    for seed in range(11, 14):  # 9 new blocks: more than the host tier holds
        run(manager, prompt(seed))
    assert on_host(manager, retained) == [False, False, False]


# Decay: 50 s after the hit, 10 s of protection would be left, too little against churn
# released just now; 20 s after it, 40 s is.
@pytest.mark.parametrize(("priority", "later"), [("pin", 50.0), ("decay", 20.0)])
def test_a_later_request_extends_the_lifetime(priority, later):
    clock = Clock()
    manager = make_manager(clock, retained_priority=priority)
    retained = run(manager, prompt(1), RETAIN)
    clock.now += 50.0
    run(manager, prompt(1), RETAIN)  # a hit: its blocks' deadline moves to now + 60
    clock.now += later  # past the first deadline
    for seed in range(10, 14):
        run(manager, prompt(seed))
    assert on_host(manager, retained) == [True, True, True]


@pytest.mark.parametrize("priority", ["decay", "pin"])
def test_the_retained_share_caps_what_is_kept(priority):
    clock = Clock()
    manager = make_manager(
        clock, retained_share=0.25, retained_priority=priority
    )  # 2 of 8 host blocks
    first = run(manager, prompt(1), RETAIN)
    second = run(manager, prompt(2), RETAIN)  # the share is full: kept as ordinary blocks
    assert manager.host.num_retained == 2
    for seed in range(10, 14):
        run(manager, prompt(seed))
    assert on_host(manager, first) == [True, True, False]
    assert on_host(manager, second) == [False, False, False]


def test_retention_stores_the_prefix_to_host_without_any_promotion():
    clock = Clock()
    manager = make_manager(clock, write_through_threshold=0)
    ordinary = run(manager, prompt(2))
    assert manager.stats.blocks_stored == 0 and on_host(manager, ordinary) == [False] * 3
    retained = run(manager, prompt(1), CacheHints(retain_tokens=9, ttl_s=60.0))
    assert manager.stats.blocks_stored == 2  # 9 tokens: two whole blocks
    assert on_host(manager, retained) == [True, True, False]


def test_without_hints_nothing_is_retained():
    clock = Clock()
    manager = make_manager(clock)
    run(manager, prompt(1), CacheHints(key="k"))  # a routing key alone keeps nothing
    run(manager, prompt(2))
    assert manager.host.num_retained == 0


@pytest.mark.parametrize("priority", ["decay", "pin"])
def test_block_pool_evicts_every_ordinary_block_before_a_retained_one(priority):
    clock = Clock()
    pool = BlockPool(4, "host", max_retained=1, clock=clock, retained_priority=priority)
    ids, _ = pool.allocate(4)
    for i, block_id in enumerate(ids):
        assert pool.cache(block_id, bytes([i]))
    assert pool.retain(ids[0], clock.now + 10)
    assert not pool.retain(ids[1], clock.now + 10)  # max_retained 1
    pool.free(ids)
    assert pool.eviction_order() == [ids[1], ids[2], ids[3], ids[0]]
    _, evicted = pool.allocate(3)
    assert [block_id for block_id, _ in evicted] == ids[1:]
    clock.now += 10
    assert pool.expire() == 1 and pool.num_retained == 0
    assert pool.eviction_order() == [ids[0]]
    pool.check_integrity()


def test_a_retained_disk_block_outlives_ordinary_ones(tmp_path):
    clock = Clock()
    store = DiskStore(
        str(tmp_path), "fp", "full", (2, 2), torch.float32, 3, max_retained=1, clock=clock
    )
    try:
        block = torch.zeros(2, 2)
        store.store(b"k" * 16, block, retained_until=clock.now + 10)
        store.store(b"a" * 16, block)
        store.store(b"b" * 16, block)
        assert store.usage().num_retained == 1
        store.store(b"c" * 16, block)  # evicts a (the retained k is older)
        store.store(b"d" * 16, block)  # evicts b
        assert store.contains(b"k" * 16) and not store.contains(b"a" * 16)
        assert not store.retain(b"c" * 16, clock.now + 10)  # the share is full
        clock.now += 11
        store.store(b"e" * 16, block)  # k expired: ordinary, and the least recently used
        assert not store.contains(b"k" * 16) and store.usage().num_retained == 0
    finally:
        store.close()


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_bad_retained_share_fails_naming_the_option(share):
    with pytest.raises(ValueError, match=r"retained_share \(--experimental-kv-offload-retained"):
        KVOffloadConfig(retained_share=share)


def test_the_retained_share_flag_sets_the_config_and_a_bad_one_exits_2():
    argv = ["serve", "--experimental-kv-offload-host-memory-ratio", "1"]
    share = "--experimental-kv-offload-retained-share"
    config = build_config(build_parser().parse_args([*argv, share, "0.5"]))
    assert config.scheduler.kv_offload_config.retained_share == 0.5
    assert (
        build_config(build_parser().parse_args(argv)).scheduler.kv_offload_config.retained_share
        == 0.25
    )
    assert main([*argv, share, "1.5"]) == 2


@pytest.mark.parametrize("priority", ["decay", "pin"])
def test_extending_a_retention_keeps_one_deadline_per_block(priority):
    clock = Clock()
    pool = BlockPool(2, "host", max_retained=2, clock=clock, retained_priority=priority)
    (block_id,), _ = pool.allocate(1)
    pool.cache(block_id, b"h")
    pool.free([block_id])
    for _ in range(100):  # a hot prefix: every request pushes its deadline on
        assert pool.retain(block_id, clock.now + 10)
        clock.now += 1
    assert len(pool._deadlines) == 1
    assert pool.expire() == 0 and pool.num_retained == 1  # deadline 1109, now 1100
    clock.now += 10
    assert pool.expire() == 1 and pool.eviction_order() == [1, block_id]
    pool.check_integrity()


@pytest.mark.parametrize("threshold", [0, "immediate"])
def test_a_retained_prefix_goes_to_disk_once_its_host_copy_has_landed(tmp_path, threshold):
    clock = Clock()
    disk = DiskStore(
        str(tmp_path), "fp", "full", (2, 2), torch.float32, 8, max_retained=4, clock=clock
    )
    manager = KVCacheManager(
        8,
        BS,
        num_host_blocks=8,
        write_through_threshold=threshold,
        backing={"disk": {"full": disk}},
        retained_share=0.5,
        clock=clock,
    )
    try:
        request = Request("kept", prompt(1), SamplingParams(), BS, cache_hints=RETAIN)
        match = manager.match_prefix(request)
        assert manager.allocate_slots(request, request.num_tokens, match)
        manager.record_admission(request, match)
        request.num_computed_tokens = request.num_tokens
        manager.cache_blocks(request)
        manager.free(request)
        first = manager.take_transfer_plan()
        # Never read from host before the NPU -> host store lands: no disk store yet.
        assert len(first.stores) == 3 and not first.backing_stores
        manager.complete_transfer(first)
        second = manager.take_transfer_plan()
        assert [c.block_hash for c in second.backing_stores] == request.block_hashes[:3]
        assert {c.retained_until for c in second.backing_stores} == {clock.now + 60.0}
        for copy in second.backing_stores:  # what KVTransfer does with each
            disk.store(copy.block_hash, torch.zeros(2, 2), copy.retained_until)
        manager.complete_transfer(second)
        assert disk.usage().num_retained == 3
        assert manager.views.usage()["full"].of(Tier.DISK).num_retained == 3
        manager.check_integrity()
    finally:
        disk.close()
