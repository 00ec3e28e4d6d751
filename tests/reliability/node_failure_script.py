"""Run by test_node_failure.py in its own process: two replicas on a two-node Ray cluster on this
machine (``ray.cluster_utils.Cluster``); the node that is not the head dies, without warning,
while requests stream; then a fresh node joins and the lost replica comes back on it.

Prints one JSON line starting with ``{"node_failure"``.
"""

import asyncio
import json
import re
import sys
import time

import ray
from ray.cluster_utils import Cluster

from cluster.backend import ReplicaFailedError
from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from replicas.sampling_params import SamplingParams

# Node death is noticed after health_check_period_ms * health_check_failure_threshold (Ray's
# defaults: 3 s * 5); shorter here so that the test takes seconds, not half a minute.
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
REQUEST_TIMEOUT_S = 120.0
LONG_TOKENS = 1000
"""Tokens of each request in flight when the node dies: enough that they are still streaming
2 s in on an idle machine (300 sometimes all finished first, and nothing was lost)."""
RESTART_TIMEOUT_S = 180.0


async def one(backend: RayBackend, request_id: str, max_tokens: int) -> tuple[float, object]:
    """(time sent, final output or the exception), never waiting past the timeout."""
    sent = time.monotonic()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens = [1 + len(request_id) % 200, 2, 3, *request_id.encode()[-6:]]

    async def run():
        final = None
        async for output in backend.generate(request_id, tokens, params):
            final = output
        return final

    try:
        return sent, await asyncio.wait_for(run(), REQUEST_TIMEOUT_S)
    except Exception as error:  # classified by the caller
        return sent, error


async def wait_unreachable(replica, incarnation: str) -> None:
    """Until the replica's old process no longer answers (bounded): its processes die a moment
    after the node's raylet is killed."""
    for _ in range(600):
        try:
            if await asyncio.wait_for(replica.ready.remote(), 1.0) != incarnation:
                return
        except Exception:  # lost, or no answer within a second
            return
        await asyncio.sleep(0.1)


async def scenario(backend: RayBackend, cluster: Cluster, worker, doomed: int) -> dict:
    in_flight = [asyncio.ensure_future(one(backend, f"long-{i}", LONG_TOKENS)) for i in range(8)]
    await asyncio.sleep(2.0)
    cluster.remove_node(worker, allow_graceful=False)
    await wait_unreachable(backend.replicas[doomed], backend.health.incarnations[doomed])
    killed_at = time.monotonic()
    later = []
    for i in range(12):  # new requests while the node is being declared dead, and after
        later.append(asyncio.ensure_future(one(backend, f"later-{i}", 16)))
        await asyncio.sleep(0.5)
    results = await asyncio.gather(*in_flight, *later)

    served, lost, errors = [], [], []
    for sent, result in results:
        if isinstance(result, ReplicaFailedError):
            lost.append((sent, int(re.search(r"replica (\d+)", str(result)).group(1))))
        elif isinstance(result, BaseException) or result is None or not result.finished:
            errors.append(repr(result))
        else:
            served.append((sent, result.replica_index))
    after_kill = [index for sent, index in served if sent > killed_at]
    live_after_kill = await backend.num_live_replicas()

    cluster.add_node(num_cpus=1)  # the placement group's lost bundle is placed again here
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while await backend.num_live_replicas() < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    rejoined = await backend.num_live_replicas() == 2
    final = await asyncio.gather(*(one(backend, f"final-{i}", 4) for i in range(4)))
    return {
        "doomed": doomed,
        "served": len(served),
        "lost": len(lost),
        "lost_sent_before_kill": all(sent < killed_at for sent, _ in lost),
        "lost_on": sorted({index for _, index in lost}),
        "errors": errors,
        "served_after_kill_by": sorted(set(after_kill)),
        "num_served_after_kill": len(after_kill),
        "num_sent_after_kill": len(later),
        "live_after_kill": live_after_kill,
        "rejoined": rejoined,
        "final_ok": all(getattr(r, "finished", False) for _, r in final),
        "rerouted": backend.dispatcher.counts.num_rerouted,
        "resumed": backend.dispatcher.counts.num_resumed,
    }


def main() -> None:
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": SYSTEM_CONFIG}
    )
    worker = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, namespace="strata-node-failure")
    config = ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            "model": {"model": "tiny", "num_npu_blocks": 128},
            "routing": {"scoring_profile": "load"},
            "ray": {"cpus_per_replica": 0.5, "placement_strategy": "STRICT_SPREAD"},
        }
    )
    backend = RayBackend(config, name="nodefail")
    head = ray.get_runtime_context().get_node_id()
    doomed = next(i for i, info in enumerate(backend.replica_infos) if info["node_id"] != head)
    start = time.monotonic()
    result = asyncio.run(scenario(backend, cluster, worker, doomed))
    result["elapsed_s"] = round(time.monotonic() - start, 1)
    result["integrity"] = asyncio.run(backend.check_integrity()) if result["rejoined"] else None
    print(json.dumps({"node_failure": result}), flush=True)
    backend.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
