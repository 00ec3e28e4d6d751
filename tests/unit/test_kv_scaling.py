"""The replica side of scaling: hit weights, shedding waiting requests, writing hot blocks to the
node's disk tier and a new replica's warm start from it (engines, no Ray)."""

import asyncio
import random

import pytest
import torch

from cluster import KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.actor import ReplicaUnavailableError
from replicas.config import EngineConfig
from replicas.engine.async_engine import AsyncEngine
from replicas.engine.engine import Engine
from replicas.kv.disk import DiskStore
from replicas.kv.events import KVEventKind, Tier
from replicas.kv.hashing import block_hashes
from replicas.kv.hotness import HIT_HALF_LIFE_S, HitWeights
from tests.unit.engine_runs import GREEDY, run

NUM_NPU_BLOCKS = 48


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prompt(seed: int, num_blocks: int = 4) -> list[int]:
    """``num_blocks`` full blocks and a 3-token tail (the blocks a match can reuse)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(16 * num_blocks + 3)]


def prefix_hashes(tokens: list[int], num_blocks: int = 4) -> list[bytes]:
    return block_hashes(tokens, 16)[:num_blocks]


def engine(
    disk_path=None, *, host_ratio: float = 2.0, threshold=0, disk_blocks: int = 256, **scheduler
) -> Engine:
    """``threshold`` 0: no promotion, so blocks stay NPU-only until something copies them."""
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=host_ratio,
        write_through_threshold=threshold,
        disk_path=str(disk_path) if disk_path is not None else None,
        disk_bytes=disk_blocks * 4 * 2 * 16 * 2 * 64 * 4 if disk_path is not None else None,
    )
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=NUM_NPU_BLOCKS,
            dtype="float32",
            scheduler_config=SchedulerConfig(kv_offload_config=offload, **scheduler),
        )
    )


@pytest.fixture(scope="module")
def cold() -> Engine:
    """The reference: the same model with caching off."""
    return Engine(
        EngineConfig(
            model="tiny",
            dtype="float32",
            scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
        )
    )


# ---- hit weights ------------------------------------------------------------------------------
def test_hit_weights_grow_with_hits_and_halve_every_half_life():
    clock = Clock()
    weights = HitWeights(capacity=2, clock=clock)
    weights.hit([b"a", b"a", b"b"])
    assert weights.weight(b"a") == 2.0 and weights.weight(b"b") == 1.0
    clock.now += HIT_HALF_LIFE_S
    assert weights.weights([b"a", b"b", b"z"]) == {b"a": 1.0, b"b": 0.5, b"z": 0.0}
    weights.hit([b"a"])
    assert weights.weight(b"a") == 2.0
    clock.now += 2 * HIT_HALF_LIFE_S
    assert weights.weight(b"a") == 0.5
    weights.hit([b"c"])  # a third hash: the least recently hit (b) is dropped
    assert len(weights) == 2 and weights.weight(b"b") == 0.0 and weights.weight(b"a") == 0.5


def test_hot_blocks_are_every_npu_and_host_block_with_its_hits():
    e = engine(host_ratio=2.0, threshold="immediate")  # every block to host at first write
    hot, once = prompt(1), prompt(2)
    for i in range(3):
        run(e, hot, f"hot{i}")
    run(e, once, "once")
    blocks = e.hot_blocks()
    snapshot = e.kv_cache.views.snapshot(0, 0)
    assert set(blocks) == set(snapshot.hashes(Tier.NPU)) | set(snapshot.hashes(Tier.HOST))
    assert snapshot.hashes(Tier.HOST)  # both tiers count
    for block_hash in prefix_hashes(hot):  # two hits (the second and third request), decaying
        assert 1.0 < blocks[block_hash] <= 2.0
    for block_hash in prefix_hashes(once):  # held, never matched
        assert blocks[block_hash] == 0.0


# ---- shedding ---------------------------------------------------------------------------------
class ListSink:
    """Every request's outputs and errors, in order."""

    def __init__(self) -> None:
        self.items: dict[str, list] = {}

    def put(self, request_id: str, item) -> None:
        self.items.setdefault(request_id, []).append(item)

    def flush(self) -> None:
        pass


def test_shed_waiting_frees_every_waiting_request_and_ends_its_stream_with_the_error():
    e = engine(max_num_seqs=1)
    sink = ListSink()

    async def scenario() -> int:
        front = AsyncEngine(e, step_in_thread=False)
        for i in range(3):
            front.submit(f"r{i}", prompt(10 + i), GREEDY, None, sink)
        while "r0" not in sink.items:  # r0 runs; r1 and r2 wait behind it
            await asyncio.sleep(0)
        num_shed = await front.shed_waiting(ReplicaUnavailableError("replica is draining"))
        e.check_integrity()
        npu = e.kv_cache.views.usage()["full"].of(Tier.NPU)
        assert npu.num_used == len(e.kv_cache.block_ids("r0")) > 0  # r0's blocks only
        while not sink.items["r0"][-1].finished:
            await asyncio.sleep(0)
        await front.shutdown()
        return num_shed

    assert asyncio.run(scenario()) == 2
    for request_id in ("r1", "r2"):
        (error,) = sink.items[request_id]
        assert isinstance(error, ReplicaUnavailableError) and str(error) == "replica is draining"
    assert sink.items["r0"][-1].finish_reason == "length"
    assert len([t for o in sink.items["r0"] for t in o.new_token_ids]) == GREEDY.max_tokens
    e.check_integrity()
    assert e.kv_cache.views.usage()["full"].of(Tier.NPU).num_used == 0


def test_shed_waiting_keeps_running_and_partly_served_requests():
    e = engine(max_num_seqs=2)
    for i in range(3):
        e.add_request(f"r{i}", prompt(20 + i), GREEDY)
    e.step()  # r0 and r1 run
    assert e.shed_waiting() == ["r2"]
    assert e.shed_waiting() == []
    e.check_integrity()
    while e.has_unfinished_requests():
        e.step()
    e.check_integrity()


# ---- write-out and warm start -----------------------------------------------------------------
def test_a_new_engine_warmed_from_the_written_blocks_serves_them_from_host(tmp_path, cold):
    seen = prompt(30, num_blocks=6)
    follow_up = [*seen[:96], 5, 6, 7]  # the same six blocks, another tail
    first = engine(tmp_path, threshold=0)  # NPU only: promotion off
    run(first, seen)
    held = first.hot_blocks()
    assert first.backing["disk"]["full"].stats().num_cached == 0
    num_written = first.write_hot_blocks_to_disk(time_budget_s=60.0)
    assert num_written == len(held) == first.backing["disk"]["full"].stats().num_cached
    first.check_integrity()
    first.close()

    second = engine(tmp_path, threshold=0)
    second.kv_cache.views.enable_events()
    second.kv_cache.views.drain_events()  # the disk blocks it found
    assert second.warm_from_disk(time_budget_s=60.0) == num_written
    second.check_integrity()
    announced = {
        e.block_hash
        for e in second.kv_cache.views.drain_events()
        if e.kind == KVEventKind.STORED and e.tier == Tier.HOST
    }
    assert announced == set(held)
    assert set(second.kv_cache.views.snapshot(0, 0).hashes(Tier.HOST)) == set(held)
    output = run(second, follow_up)
    assert output.num_cached_tokens_in(Tier.HOST) == output.num_cached_tokens == 96
    assert output.token_ids == run(cold, follow_up).token_ids
    assert second.stats().cache.disk_hits == 0  # in host before the request came
    second.close()


def test_warm_start_loads_the_hottest_blocks_when_the_host_tier_is_smaller(tmp_path):
    hot, warm, cold_prompt = prompt(40), prompt(41), prompt(42)
    first = engine(tmp_path, threshold=0)
    for tokens, num_runs in ((cold_prompt, 1), (warm, 2), (hot, 3)):
        for i in range(num_runs):
            run(first, tokens, f"{tokens[0]}-{i}")
    first.write_hot_blocks_to_disk(time_budget_s=60.0)
    # The first engine still runs: the second reads its slab as another replica's.
    second = engine(tmp_path, host_ratio=8 / NUM_NPU_BLOCKS, threshold=0)  # 8 host blocks
    assert second.backing["disk"]["full"].slab != first.backing["disk"]["full"].slab
    assert second.warm_from_disk(time_budget_s=60.0) == 8
    host = set(second.kv_cache.views.snapshot(0, 0).hashes(Tier.HOST))
    assert host == set(prefix_hashes(hot)) | set(prefix_hashes(warm))
    second.check_integrity()
    second.close()
    first.close()


def test_a_time_budget_of_zero_copies_nothing(tmp_path):
    first = engine(tmp_path, threshold=0)
    run(first, prompt(50))
    assert first.write_hot_blocks_to_disk(time_budget_s=0.0) == 0
    assert first.backing["disk"]["full"].stats().num_cached == 0
    first.check_integrity()
    assert first.write_hot_blocks_to_disk(time_budget_s=60.0) > 0
    second = engine(tmp_path, threshold=0)
    assert second.warm_from_disk(time_budget_s=0.0) == 0
    assert second.kv_cache.views.usage()["full"].of(Tier.HOST).num_cached == 0
    second.close()
    first.close()


def test_without_a_disk_tier_nothing_is_copied():
    e = engine(threshold=0)
    run(e, prompt(60))
    assert e.write_hot_blocks_to_disk(60.0) == 0
    assert e.warm_from_disk(60.0) == 0
    e.check_integrity()


def test_write_out_stages_npu_blocks_through_a_small_host_tier(tmp_path):
    """More NPU blocks to write than host blocks to stage them in: rounds go on until all are
    written, host blocks chosen first stay until written."""
    first = engine(tmp_path, host_ratio=3 / NUM_NPU_BLOCKS, threshold=0)  # 3 host blocks
    for i in range(4):
        run(first, prompt(70 + i), f"p{i}")
    held = first.hot_blocks()
    assert first.write_hot_blocks_to_disk(time_budget_s=60.0) == len(held) > 3
    first.check_integrity()
    assert set(first.backing["disk"]["full"].cached_hashes()) == set(held)
    first.close()


def test_a_full_slab_takes_hotter_blocks_and_never_gives_a_hotter_one_for_colder(tmp_path):
    first = engine(tmp_path, threshold=0, disk_blocks=4)
    hot, colder, hottest = prompt(80), prompt(81), prompt(82)
    for i in range(3):
        run(first, hot, f"hot{i}")
    run(first, colder, "colder")
    assert first.write_hot_blocks_to_disk(time_budget_s=60.0) == 4  # the slab's 4 slots
    disk = first.backing["disk"]["full"]
    assert set(disk.cached_hashes()) == set(prefix_hashes(hot))
    assert first.write_hot_blocks_to_disk(time_budget_s=60.0) == 0  # colder: kept out
    assert set(disk.cached_hashes()) == set(prefix_hashes(hot))
    for i in range(5):
        run(first, hottest, f"hottest{i}")
    assert first.write_hot_blocks_to_disk(time_budget_s=60.0) == 4
    assert set(disk.cached_hashes()) == set(prefix_hashes(hottest))
    first.check_integrity()
    first.close()


# ---- the disk store's hotness ---------------------------------------------------------------
def disk_store(path, num_slots: int, wall: Clock) -> DiskStore:
    return DiskStore(str(path), "fp", "full", (2, 2), torch.float32, num_slots, wall_clock=wall)


def test_disk_records_keep_hit_weights_for_every_replica_of_the_node(tmp_path):
    wall = Clock()
    block = torch.zeros(2, 2)
    writer = disk_store(tmp_path, 3, wall)
    for key, weight in ((b"a" * 16, 0.0), (b"b" * 16, 5.0), (b"c" * 16, 1.0)):
        writer.store(key, block, weight=weight)
    writer.flush()
    assert writer.hottest() == [b"b" * 16, b"c" * 16, b"a" * 16]
    # Full: a block of weight 3 replaces a (0), one of 0.5 replaces nothing (c has 1).
    assert writer.room_for([3.0, 0.5]) == (1, [b"a" * 16])
    assert writer.room_for([3.0, 2.0]) == (2, [b"a" * 16, b"c" * 16])
    writer.set_weight(b"a" * 16, 9.0)
    writer.flush()
    wall.now += HIT_HALF_LIFE_S
    reader = disk_store(tmp_path, 3, wall)  # another replica: slab 1, reads slab 0
    assert reader.slab == 1
    assert reader.hottest() == [b"a" * 16, b"b" * 16, b"c" * 16]
    assert reader._ranking.weight(b"a" * 16) == pytest.approx(4.5)
    reader.close()
    writer.close()
    restarted = disk_store(tmp_path, 3, wall)  # takes slab 0 back, with its weights
    assert restarted.slab == 0 and restarted._ranking.weight(b"b" * 16) == pytest.approx(2.5)
    restarted.close()
