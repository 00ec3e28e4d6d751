"""Run by test_multinode.py in its own process: a two-node Ray cluster on this machine."""

import asyncio
import json
import sys

import ray
from ray.cluster_utils import Cluster

from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from replicas.sampling_params import SamplingParams


async def serve_some(backend: RayBackend) -> list[int]:
    async def one(i: int) -> int:
        final = None
        async for output in backend.generate(
            f"m{i}", [1, 2, 3, i], SamplingParams(max_tokens=4, ignore_eos=True)
        ):
            final = output
        return final.replica_index

    return list(await asyncio.gather(*(one(i) for i in range(4))))


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, namespace="strata-multinode")
    config = ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            "model": {"model": "tiny", "num_npu_blocks": 64},
            "routing": {"scoring_profile": "load"},
            "ray": {"cpus_per_replica": 0.5, "placement_strategy": sys.argv[1]},
        }
    )
    backend = RayBackend(config, name="multi")
    replicas = asyncio.run(serve_some(backend))
    nodes = [info["node_id"] for info in backend.replica_infos]
    print(json.dumps({"nodes": nodes, "served_by": replicas}))
    backend.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
