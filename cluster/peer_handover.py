"""A resize's hand-over through the peer tier (``replicas.kv.tiers.peer``), across nodes: the
blocks move over Ray between replicas, not through a node's disk.

    scale-out: a new replica pulls its serving peers' hottest blocks (each from the peer that
               holds it hottest) into its empty host blocks, after its node's disk blocks and
               before it takes traffic (``warm_new_replica``)
    scale-in:  a draining replica, its requests ended, hands its hottest blocks to a survivor:
               the survivor pulls them into up to ``HANDOVER_SHARE`` of its host tier,
               evicting its own least recently used blocks first (``hand_over``)

and, with pulling on, a new replica times pulls from a peer before it takes traffic, as a
deployment's first replicas do when it starts (``time_pulls``, ``ReplicaActor.probe_peer``).

Both are bounded by ``server.warm_start_budget_s`` and are on only where the replicas have the
peer tier (``kv_offload_config.tiers: {peer: {}}``). A source or puller that fails or answers
late costs blocks not moved, never a request.
"""

import asyncio
import logging
from typing import Any

from ray.exceptions import RayTaskError

from cluster.config import ClusterConfig
from cluster.health import ACTOR_LOST, HEALTH_TIMEOUT_S

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0
"""The longest a deployment waits for new replicas to time pulls from their peers."""
HANDOVER_SHARE = 0.5
"""The most of a survivor's host tier a leaving replica's blocks may take, so that the
survivor's own hot blocks stay."""


def has_peer_tier(config: ClusterConfig) -> bool:
    offload = config.scheduler.kv_offload_config
    return offload.is_active and "peer" in offload.tiers


async def hot_blocks(replica: Any, index: int) -> dict[bytes, float]:
    """Replica ``index``'s pooled blocks with their hit weights; none from one that fails or
    answers late."""
    try:
        return await asyncio.wait_for(replica.hot_blocks.remote(), HEALTH_TIMEOUT_S)
    except (*ACTOR_LOST, RayTaskError, TimeoutError) as error:
        logger.warning("hand-over: replica %d did not report its blocks: %r", index, error)
        return {}


async def time_pulls(replica: Any, index: int, peer: Any) -> bool:
    """New replica ``index`` times pulls from ``peer`` (``ReplicaActor.probe_peer``), so that it
    prices its first pull with measured costs; False, with a warning, if that failed."""
    try:
        timed = await asyncio.wait_for(replica.probe_peer.remote(peer), PROBE_TIMEOUT_S)
    except (*ACTOR_LOST, RayTaskError, TimeoutError) as error:
        timed = False
        logger.warning("replica %d could not time a pull from its peer: %r", index, error)
    return bool(timed)


async def warm_new_replica(
    replica: Any, index: int, peers: dict[int, Any], time_budget_s: float
) -> int:
    """New replica ``index`` pulls the hottest blocks of ``peers`` (index -> actor) into its
    empty host blocks within ``time_budget_s``; returns how many it loaded."""
    if not peers or time_budget_s <= 0:
        return 0
    reports = await asyncio.gather(*(hot_blocks(peer, i) for i, peer in peers.items()))
    sources = [(i, peer, hot) for (i, peer), hot in zip(peers.items(), reports) if hot]
    if not sources:
        return 0
    return await _pull(replica, index, sources, time_budget_s, 0.0, "scale-out")


async def hand_over(
    victim: Any, victim_index: int, survivor: Any, survivor_index: int, time_budget_s: float
) -> int:
    """Survivor ``survivor_index`` pulls draining replica ``victim_index``'s hottest blocks into
    up to ``HANDOVER_SHARE`` of its host tier within ``time_budget_s``; returns how many."""
    if time_budget_s <= 0:
        return 0
    hot = await hot_blocks(victim, victim_index)
    if not hot:
        return 0
    sources = [(victim_index, victim, hot)]
    return await _pull(survivor, survivor_index, sources, time_budget_s, HANDOVER_SHARE, "scale-in")


async def _pull(
    replica: Any,
    index: int,
    sources: list[tuple[int, Any, dict[bytes, float]]],
    time_budget_s: float,
    max_share: float,
    what: str,
) -> int:
    """Replica ``index`` pulls ``sources``' blocks (``ReplicaActor.warm_from_peers``); 0 when
    it fails (it serves without them)."""
    try:
        num_loaded = await replica.warm_from_peers.remote(sources, time_budget_s, max_share)
    except (*ACTOR_LOST, RayTaskError) as error:
        logger.warning("%s: replica %d did not pull from its peers: %s", what, index, error)
        return 0
    logger.info(
        "%s: replica %d pulled %d blocks from replica(s) %s",
        what,
        index,
        num_loaded,
        [i for i, _, _ in sources],
    )
    return num_loaded
