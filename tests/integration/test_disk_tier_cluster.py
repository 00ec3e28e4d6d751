"""The disk tier on a Ray deployment: two replicas of one node read each other's disk blocks,
and a redeployed server serves a prefix from the disk the last one wrote."""

import time

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from replicas.kv.events import Tier
from replicas.sampling_params import SamplingParams
from tests.integration.test_cluster import run, run_one

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
PREFIX = list(range(1, 161))  # 10 full blocks


def disk_config(path) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            "model": {"model": "tiny", "num_npu_blocks": 256},
            "routing": {"scoring_profile": "load"},
            "scheduler": {
                "kv_offload_config": {
                    "enabled": True,
                    "host_memory_ratio": 1.0,
                    "write_through_threshold": "immediate",
                    "disk_path": str(path),
                    "disk_bytes": 64 * 2**20,
                }
            },
            "ray": {"cpus_per_replica": 0.5},
        }
    )


@pytest.fixture
def backends(ray_session):
    started: list[RayBackend] = []
    yield started
    for backend in started:
        backend.shutdown()


def test_replicas_share_the_node_disk_and_a_redeployment_reuses_it(backends, tmp_path):
    first = RayBackend(disk_config(tmp_path), name="t-disk-a")
    backends.append(first)
    writer = run(run_one(first, "w", [*PREFIX, 200], PARAMS))
    assert writer.num_cached_tokens == 0
    time.sleep(0.5)  # the writes land and the replicas' KV events reach the router
    run(first.reset_prefix_cache("npu"))
    run(first.reset_prefix_cache("host"))
    time.sleep(0.5)
    # The load profile sends the next request to the other replica (it has computed less),
    # which finds the prefix in the writer's slab.
    reader = run(run_one(first, "r", [*PREFIX, 201], PARAMS))
    assert reader.replica_index != writer.replica_index
    assert reader.num_cached_tokens == reader.num_cached_tokens_in(Tier.HOST) == 160
    for report in run(first.check_integrity()):
        assert report == {"npu_blocks_used": 0, "host_blocks_used": 0, "num_unfinished": 0}
    first.shutdown()

    second = RayBackend(disk_config(tmp_path), name="t-disk-b")
    backends.append(second)
    again = run(run_one(second, "again", [*PREFIX, 200], PARAMS))
    assert again.num_cached_tokens == 160
    assert again.token_ids == writer.token_ids


def test_a_redeployed_replica_announces_its_disk_blocks_before_any_traffic(backends, tmp_path):
    first = RayBackend(disk_config(tmp_path), name="t-disk-c")
    backends.append(first)
    run(run_one(first, "w", [*PREFIX, 200], PARAMS))
    time.sleep(0.5)
    first.shutdown()
    second = RayBackend(disk_config(tmp_path), name="t-disk-d")
    backends.append(second)
    time.sleep(0.5)  # the announcements reach the router
    stats = ray.get(second.router.stats.remote())
    assert stats.num_indexed_hashes == 0  # nothing on NPU or host yet
    disk = [r.num_indexed_blocks_in(Tier.DISK) for r in stats.replicas]
    assert sum(disk) >= 10  # the writer's slab, taken back by one of the new replicas
