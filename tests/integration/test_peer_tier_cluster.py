"""The peer tier on a Ray deployment: a replica the router sends a prompt to pulls the prefix
another replica computed, through Ray, with the output of a cold run."""

import time

import pytest

from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from replicas.kv.events import Tier
from replicas.sampling_params import SamplingParams
from tests.integration.test_cluster import run, run_one
from tests.tier_registry import restored_tier_registry

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
PREFIX = list(range(1, 161))  # 10 full blocks


@pytest.fixture
def backend(ray_session):
    config = ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            "model": {"model": "tiny", "num_npu_blocks": 256},
            "routing": {"policy": "round-robin"},  # the second request goes to the other one
            "scheduler": {
                "kv_offload_config": {
                    "enabled": True,
                    "host_memory_ratio": 1.0,
                    "tiers": {"peer": {}},
                }
            },
            "ray": {"cpus_per_replica": 0.5},
        }
    )
    started = RayBackend(config, name="t-peer")
    yield started
    started.shutdown()


@pytest.fixture(autouse=True)
def peer_registered():
    """The config registers the peer tier in this process; the registry is as before after."""
    with restored_tier_registry():
        yield


def test_a_replica_pulls_the_prefix_another_replica_computed(backend):
    writer = run(run_one(backend, "w", [*PREFIX, 200], PARAMS))
    time.sleep(0.5)  # the writer's KV events reach the router
    reader = run(run_one(backend, "r", [*PREFIX, 201], PARAMS))
    assert reader.replica_index != writer.replica_index
    assert reader.num_cached_tokens == reader.num_cached_tokens_in(Tier.HOST) == 160
    stats = run(backend.stats())
    pulled = [r.engine.cache.peer_blocks_loaded for r in stats.replicas if r.engine is not None]
    assert sorted(pulled) == [0, 10]
    # each replica timed pulls of 1 and 16 blocks from the other at start-up
    # (ReplicaActor.probe_peer), the reader its real pull besides
    timed = [r.engine.backing["peer"]["full"].timed_pulls for r in stats.replicas if r.engine]
    assert len(timed) == 2 and min(timed) >= 2 and max(timed) >= 3
    # each replica reported what a pull costs it (router.peer_sources)
    break_even = [r.peer_break_even_blocks for r in stats.router.replicas]
    assert all(n is not None and n >= 1 for n in break_even)
    run(backend.reset_prefix_cache("all"))
    time.sleep(0.5)
    cold = run(run_one(backend, "cold", [*PREFIX, 201], PARAMS))
    assert cold.num_cached_tokens == 0 and cold.token_ids == reader.token_ids
