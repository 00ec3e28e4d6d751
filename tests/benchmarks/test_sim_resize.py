"""Resize events in the simulator (``benchmarks.sim.resize``): which replica a scale-in removes,
that nothing is lost, and that a drained replica's blocks are served from the disk tier."""

import pytest

from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.resize import Resize, ResizingSimulator
from benchmarks.sim.simulator import SimConfig
from benchmarks.sim.trace import TraceRecord, expand
from replicas.kv.events import Tier
from replicas.kv.hashing import block_hashes

BLOCK = 16
PROFILE = HardwareProfile.load("cpu-tiny")
HOT = (1, 2, 3, 4)  # asked for again and again
COLD = (10, 11, 12, 13)  # asked for once before the scale-in, then again after it


def trace() -> list[TraceRecord]:
    """One request a second: the cold prefix, the hot one eight times, (a scale-in at 10.5 s),
    the cold prefix again, then the hot one."""
    prompts = [COLD] + [(*HOT, 100 + i) for i in range(8)] + [(*COLD, 200)]
    prompts += [(*COLD, 201)] + [(*HOT, 300 + i) for i in range(6)]
    return [TraceRecord(1000.0 * i, 512 * len(ids), 32, ids) for i, ids in enumerate(prompts)]


def simulate(rule: str, resizes: list[Resize], seed: int = 0, **options) -> ResizingSimulator:
    config = SimConfig(
        data_parallel_size=2,
        block_size=BLOCK,
        tokens_per_hash_id=BLOCK,
        token_scale=1.0,
        num_npu_blocks=64,
        seed=seed,
        scoring_profile="locality",
        **options,
    )
    requests = expand(trace(), BLOCK)
    simulator = ResizingSimulator(
        config, CostModel(PROFILE, BLOCK, 1.0), requests, resizes, rule, window_s=5.0
    )
    simulator.record = simulator.run()
    return simulator


def hot_replica(sim: ResizingSimulator) -> int:
    """The replica that served the hot prefix's repeats (from the served requests)."""
    replicas = {s.replica for s in sim.served if s.arrival_s < 9 and s.num_cached_tokens}
    (replica,) = replicas
    return replica


def test_a_cache_aware_scale_in_removes_the_replica_with_the_fewest_hot_blocks():
    sim = simulate("cache-aware", [Resize(9.5, 1)])
    (entry,) = sim.record["resizes"]
    assert entry["removed"] == [1 - hot_replica(sim)]
    assert sim.record["num_failed"] == 0
    assert sim.record["num_finished"] == len(sim.requests)
    # the hot prefix keeps hitting after the scale-in: every repeat caches its 4 blocks
    after = [s for s in sim.served if s.arrival_s >= 11]
    assert [s.num_cached_tokens for s in after] == [4 * BLOCK] * 6


def test_a_drained_replicas_blocks_reach_a_survivor_through_the_disk_tier():
    disk = {"host_memory_ratio": 1.0, "disk_memory_gb": 0.01}
    sim = simulate("cache-aware", [Resize(9.5, 1)], **disk)
    assert sim.record["num_blocks_written_to_disk"] >= len(COLD)
    cold_again = [s for s in sim.served if 9 < s.arrival_s < 10.5]
    assert [s.num_cached_tokens for s in cold_again] == [len(COLD) * BLOCK]
    without = simulate("cache-aware", [Resize(9.5, 1)])  # no disk tier: recomputed
    cold_again = [s for s in without.served if 9 < s.arrival_s < 10.5]
    assert [s.num_cached_tokens for s in cold_again] == [0]


@pytest.mark.parametrize("rule", ["cache-aware", "random", "restart"])
def test_every_rule_finishes_every_request_and_never_reuses_an_index(rule: str):
    sim = simulate(rule, [Resize(9.5, 1), Resize(12.5, 3)], seed=3)
    assert sim.record["num_failed"] == 0
    first, second = sim.record["resizes"]
    if rule == "restart":
        assert (first["removed"], first["added"]) == ([0, 1], [2])
        assert (second["removed"], second["added"]) == ([2], [3, 4, 5])
    else:
        assert len(first["removed"]) == 1 and "added" not in first
        assert second["added"] == [2, 3]
    assert sorted(sim.serving) == sorted(set(sim.serving))
    assert len(sim.serving) == 3
    assert sim.router.live_replicas() == sorted(sim.serving)
    sim.router.check_integrity()
    assert {n["replica"] for n in sim.record["new_replicas"]} == set(range(2, len(sim.engines)))


def test_restart_counts_the_requests_it_would_lose():
    sim = simulate("restart", [Resize(4.000001, 2)])  # request 4 arrived at 4 s, running
    assert sim.record["num_interrupted"] >= 1
    live = simulate("cache-aware", [Resize(4.000001, 2)])
    assert live.record["num_interrupted"] == 0


def test_a_new_replica_warms_its_host_tier_from_the_disk_before_it_serves():
    disk = {
        "host_memory_ratio": 1.0,
        "disk_memory_gb": 0.01,
        "write_through_threshold": "immediate",
    }
    sim = simulate("cache-aware", [Resize(9.5, 3)], announce_disk_blocks=True, **disk)
    (entry,) = sim.record["resizes"]
    assert entry["added"] == [2]
    on_disk = set(sim.disk_views[0]["full"].disk.holders)
    hot = block_hashes(sim.requests[1].prompt_token_ids, BLOCK)[: len(HOT)]
    assert set(hot) <= on_disk  # every host block is stored to disk at threshold 0
    (new,) = sim.record["new_replicas"]
    assert new["num_blocks_warmed"] > 0
    assert new["start_s"] > 9.5  # it serves once its reads have landed
    host = sim.engines[2].kv_cache.views.snapshot(2, 0).hashes(Tier.HOST, "full")
    assert set(hot) <= set(host)
    assert sim.record["num_failed"] == 0
    sim.router.check_integrity()
    sim.engines[2].kv_cache.check_integrity()
