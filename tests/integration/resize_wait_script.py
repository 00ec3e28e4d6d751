"""Run by test_resize_wait.py in its own process: a scale-out on a Ray cluster that grows.

A head node of 1 CPU holds the one replica; ``scale(2)`` waits (its placement group pending)
until a second node joins, and the new replica there pulls through the peer tier the prefix the
first computed. Then a scale-out the cluster never grows for is refused after
``ray.scale_out_wait_s``, the deployment as it was; and a scale-in removes the head node's
replica, whose blocks the survivor on the other node pulls before it goes. Prints one JSON
line.
"""

import asyncio
import json
import logging
import time

import ray
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from replicas.kv.events import Tier
from replicas.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = [*range(1, 161), 200]  # 10 full blocks of 16 tokens, and one more token
WAIT_S = 2.0


async def serve(backend: RayBackend, request_id: str, tokens: list[int] = PROMPT):
    final = None
    async for output in backend.generate(request_id, tokens, PARAMS):
        final = output
    return final


def config() -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": 1,
            "model": {"model": "tiny", "num_npu_blocks": 64},
            "scheduler": {
                "kv_offload_config": {
                    "enabled": True,
                    "host_memory_ratio": 1.0,
                    "tiers": {"peer": {}},
                }
            },
            "routing": {"policy": "round-robin"},
            "ray": {"cpus_per_replica": 1, "scale_out_wait_s": 120},
        }
    )


async def grow(backend: RayBackend, cluster: Cluster) -> dict:
    """scale(2) waits for a node; one joins; the new replica serves the prompt from its peer."""
    cold = await serve(backend, "cold")
    scaling = asyncio.ensure_future(backend.scale(2))
    await asyncio.sleep(2.0)
    pending = not scaling.done()
    during = await serve(backend, "during", [7, 8, 9])  # serving goes on while it waits
    node = cluster.add_node(num_cpus=1)  # on the main thread (it sets signal handlers)
    start = time.monotonic()
    result = await scaling
    scale_s = time.monotonic() - start
    await asyncio.sleep(0.5)  # replica 0's KV events reach the router
    warm = None
    for i in range(3):  # round robin: one of the next requests goes to replica 1
        warm = await serve(backend, f"warm-{i}")
        if warm.replica_index == 1:
            break
    return {
        "pending_after_2s": pending,
        "served_while_waiting": during.replica_index == 0 and bool(during.token_ids),
        "scale": result.as_dict(),
        "scale_after_node_s": round(scale_s, 2),
        "nodes": [backend.membership[i].node_id for i in (0, 1)],
        "added_node": node.node_id,
        "cold": [cold.replica_index, cold.num_cached_tokens, list(cold.token_ids)],
        "warm": [warm.replica_index, warm.num_cached_tokens, list(warm.token_ids)],
        "warm_from_host": warm.num_cached_tokens_in(Tier.HOST),
    }


async def refuse(backend: RayBackend) -> dict:
    """scale(4) on a cluster that does not grow: refused after WAIT_S, nothing changed."""
    ray_config = backend.config.ray.model_copy(update={"scale_out_wait_s": WAIT_S})
    backend.resizer.config = backend.config.model_copy(update={"ray": ray_config})
    start = time.monotonic()
    scaling = asyncio.ensure_future(backend.scale(4))
    during = await serve(backend, "refused-during", [7, 8, 9, 10])
    pending_when_served = not scaling.done()
    try:
        await scaling
        error = ""
    except ValueError as refused:
        error = str(refused)
    refused_s = time.monotonic() - start
    after = await serve(backend, "after", [7, 8, 9, 11])
    states = [g["state"] for g in placement_group_table().values()]
    return {
        "error": error,
        "refused_s": round(refused_s, 2),
        "served_while_waiting": pending_when_served and bool(during.token_ids),
        "size_after": backend.num_replicas(),
        "members_after": backend.membership.members(),
        "served_after": bool(after.token_ids),
        "pending_groups": states.count("PENDING"),
    }


async def serve_on(backend: RayBackend, index: int, request_id: str, tokens: list[int]):
    """Serve ``tokens`` on replica ``index`` (round robin: the request after one on the other
    replica lands there)."""
    filler = await serve(backend, f"{request_id}-filler", [5, 6, 7])
    if filler.replica_index == index:
        await serve(backend, f"{request_id}-filler-2", [5, 6, 8])
    return await serve(backend, request_id, tokens)


async def shrink(backend: RayBackend) -> dict:
    """Replica 0 (head node) holds OTHER, replica 1 (the added node) holds a hotter prompt of
    its own: scale(1) removes replica 0, and replica 1 pulls its blocks before it goes."""
    other = [(7 * i + 3) % 250 for i in range(160)] + [201]
    own = [(11 * i + 5) % 250 for i in range(160)] + [202]
    first = await serve_on(backend, 0, "other", other)
    for i in range(3):
        await serve_on(backend, 1, f"own-{i}", own)
    await asyncio.sleep(0.5)  # the KV events reach the router
    result = await backend.scale(1)
    after = await serve(backend, "other-after", other)
    return {
        "first": [first.replica_index, first.num_cached_tokens, list(first.token_ids)],
        "removed": list(result.removed),
        "after": [
            after.replica_index,
            after.num_cached_tokens_in(Tier.HOST),
            list(after.token_ids),
        ],
    }


async def scenario(backend: RayBackend, cluster: Cluster) -> dict:
    grown = await grow(backend, cluster)
    stats = await backend.stats()
    grown["peer_blocks_loaded"] = [r.engine.cache.peer_blocks_loaded for r in stats.replicas]
    grown["timed_pulls"] = [r.engine.backing["peer"]["full"].timed_pulls for r in stats.replicas]
    refusal = await refuse(backend)
    return {**grown, "refusal": refusal, "shrink": await shrink(backend)}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("cluster.resize").setLevel(logging.INFO)  # the wait, on stderr
    logging.getLogger("cluster.peer_handover").setLevel(logging.INFO)  # the pulls, on stderr
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    ray.init(address=cluster.address, namespace="strata-resize-wait")
    backend = RayBackend(config(), name="grow")
    try:
        result = asyncio.run(scenario(backend, cluster))
    finally:
        backend.shutdown()
        ray.shutdown()
        cluster.shutdown()
    result["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps({"resize_wait": result}))


if __name__ == "__main__":
    main()
