"""Resizing a Ray deployment while it serves (docs/design.md, "Resizing a deployment")::

    scale-out: reserve bundles -> start actors -> info -> router.add_replica (joining: indexed)
               -> warm_from_disk (its node's disk blocks into its host tier)
               -> warm_from_peers (its peers' hottest blocks, across nodes) -> ready
               -> health watches it -> router.start_routing (cold prompts ramp up over ramp_s)
    scale-in:  choose the victim by value (cluster.scaling) -> router.set_draining
               -> its requests finish (past server.drain_timeout_s its waiting ones are shed
               and routed again; running ones finish there: max_tokens bounds them)
               -> a survivor pulls its hottest blocks (warm_from_peers, across nodes)
               -> write_hot_blocks_to_disk -> kill the actor -> router.retire -> free its bundle

The pulls between replicas need the peer tier (``cluster.peer_handover``).

A scale-out needing more than the Ray cluster can place now waits, on a cluster that can grow
(``cluster.placement.can_grow``), up to ``ray.scale_out_wait_s`` for Ray to place its bundles
(their pending placement groups are the demand Ray's autoscaler sees); past it, or at once on a
Ray local to this machine or with the option at 0, it is refused (``ValueError``) and changes
nothing. Serving goes on meanwhile: only resizes wait for one another.

No request is lost: the backend never sends a request to a draining replica (it routes again a
request the router placed there before it heard of the drain, ``RayBackend._serve``), a shed
request never started and runs elsewhere, and the actor is killed only once this process has no
request on it (``Member.in_flight``).
"""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from cluster import peer_handover
from cluster.backend import ScaleResult
from cluster.config import ClusterConfig
from cluster.health import ACTOR_LOST, HEALTH_TIMEOUT_S, HealthMonitor
from cluster.membership import Membership
from cluster.peer_handover import has_peer_tier
from cluster.placement import PLACEMENT_TIMEOUT_S, ReplicaPlacement
from cluster.scaling import (
    VICTIM_RULES,
    ReplicaValue,
    VictimChoice,
    choose_random_victims,
    choose_victims,
)
from replicas.config import EngineConfig
from replicas.kv.events import Tier
from replicas.kv.hashing import BlockHash
from router.router import ReplicaRole

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
"""How often a drain looks whether the removed replica's requests have ended."""


class ReplicaStartError(RuntimeError):
    """A replica actor failed in its constructor, or before it was ready."""


class Resizer:
    """Resizes one deployment; owns the config in effect (its ``data_parallel_size`` follows
    each resize) and counts the resizes. ``start_replica(index, engine_config)`` starts a
    replica actor in the bundle ``placement`` gave ``index``; ``kill(actor)`` ends one;
    ``new_engine_config(config, num_new)`` is one new replica's engine config at ``config``'s
    size (raising ``ValueError`` when its host share holds no block or does not fit);
    ``can_grow``: whether the Ray cluster may gain nodes (a scale-out that does not fit then
    waits for it, ``ray.scale_out_wait_s``)."""

    def __init__(
        self,
        config: ClusterConfig,
        membership: Membership,
        placement: ReplicaPlacement,
        health: HealthMonitor,
        router: Any,
        start_replica: Callable[[int, EngineConfig], Any],
        kill: Callable[[Any], None],
        new_engine_config: Callable[[ClusterConfig, int], EngineConfig],
        can_grow: bool = False,
    ) -> None:
        self.config = config
        self.membership = membership
        self.placement = placement
        self.health = health
        self.router = router
        self._start_replica = start_replica
        self._kill = kill
        self._new_engine_config = new_engine_config
        self.can_grow = can_grow
        self.num_scale_events = {"out": 0, "in": 0}
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    async def scale(self, data_parallel_size: int, victim: str = "value") -> ScaleResult:
        """Resize to ``data_parallel_size`` replicas. Raises ``ValueError`` naming why for a bad
        size (not an integer, below 1, more than the Ray cluster can place now or, where it
        can grow, within ``ray.scale_out_wait_s``), leaving the deployment as it was. Calls run
        one at a time. ``victim``: how a scale-in picks, ``"value"`` (``cluster.scaling``) or
        ``"random"`` (a benchmark baseline)."""
        if victim not in VICTIM_RULES:
            raise ValueError(f"victim must be one of {VICTIM_RULES}, got {victim!r}")
        async with self._serialized():
            old = self.membership.target_size
            size = self._check_size(data_parallel_size)
            if size == old:
                logger.info("scale: the deployment already has %d replicas", size)
                return ScaleResult(old, old)
            if size > old:
                wait_s = self._placement_wait(size)
                result = ScaleResult(old, size, added=tuple(await self._scale_out(size, wait_s)))
            else:
                choices = await self._scale_in(old - size, victim)
                removed = tuple(c.replica_index for c in choices)
                reasons = {c.replica_index: c.reason for c in choices}
                result = ScaleResult(old, size, removed=removed, reasons=reasons)
            self.num_scale_events["out" if size > old else "in"] += 1
            logger.info("scale: %d -> %d replicas: %s", old, size, result.as_dict())
            return result

    def _serialized(self) -> asyncio.Lock:
        """The lock that serialises resizes, on the running loop (a new loop gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    def _check_size(self, size: object) -> int:
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"data_parallel_size must be an integer, got {size!r}")
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}")
        return size

    def _placement_wait(self, size: int) -> float:
        """How long a scale-out to ``size`` waits for the Ray cluster to grow: 0.0 when the new
        bundles fit now (``_placement_timeout`` bounds their placing), ``ray.scale_out_wait_s``
        when they do not and it can grow (a bundle larger than every node included: a larger
        node may join). Raises ``ValueError`` when they do not fit and it cannot wait (a Ray
        local to this machine, or the option at 0)."""
        num_new = size - self.membership.target_size
        if num_new <= self.placement.num_placeable():
            return 0.0
        wait_s = self.config.ray.scale_out_wait_s
        if self.can_grow and wait_s > 0:
            return wait_s
        why = (
            "this Ray instance is local to one machine and cannot grow"
            if not self.can_grow
            else "ray.scale_out_wait_s is 0, so a scale-out does not wait for it to grow"
        )
        raise ValueError(
            f"data_parallel_size {size} is more than the Ray cluster can place, and {why}: "
            + self.placement.describe_shortfall(num_new)
        )

    def _set_size(self, size: int) -> None:
        self.membership.target_size = size
        self.config = self.config.model_copy(update={"data_parallel_size": size})

    # ---- scale-out ---------------------------------------------------------------------------
    async def _scale_out(self, size: int, wait_s: float = 0.0) -> list[int]:
        """Start the new replicas and let each take traffic once it is ready, first waiting up
        to ``wait_s`` (if any) for the Ray cluster to grow enough to place them."""
        members = self.membership
        num_new = size - members.target_size
        grown = self.config.model_copy(update={"data_parallel_size": size})
        engine_config = self._new_engine_config(grown, num_new)  # the budgets at the new size
        first = len(members.replicas)
        indices = list(range(first, first + num_new))
        await self._reserve(size, indices, wait_s)
        for index in indices:
            assert members.add(self._start_replica(index, engine_config)) == index
        self._set_size(size)
        try:
            infos = await asyncio.gather(*(members.replicas[i].info.remote() for i in indices))
        except RayActorError as error:
            await self._abandon(indices)
            raise ReplicaStartError(f"a new replica could not start: {_last_line(error)}") from None
        offload = engine_config.scheduler_config.kv_offload_config
        for index, info in zip(indices, infos):
            members.set_info(index, info)
            if await self.router.add_replica.remote(members.node_ids[index]) != index:
                await self.tell_router()  # a restarted router: its size was its start-up one
            logger.info(
                "scale-out: replica %d on node %s reserves %s; host tier %s, disk tier %s",
                index,
                members.node_ids[index],
                self.placement.bundle,
                _describe_bytes(offload.host_memory_bytes, offload.host_memory_ratio),
                _describe_bytes(offload.disk_bytes, 0.0),
            )
        joins = await asyncio.gather(*(self._join(i) for i in indices), return_exceptions=True)
        failed = [i for i, outcome in zip(indices, joins) if isinstance(outcome, BaseException)]
        if failed:
            await self._abandon(failed)
            raise ReplicaStartError(
                f"new replicas {failed} failed before they were ready: "
                + "; ".join(_last_line(e) for e in joins if isinstance(e, BaseException))
            )
        return indices

    async def _reserve(self, size: int, indices: list[int], wait_s: float) -> None:
        """Bundles for the new replicas ``indices``; with ``wait_s``, their placement groups
        wait that long for Ray to place them. Raises ``ValueError`` (every bundle this call
        took given back) when Ray did not place them in time."""
        if wait_s:
            logger.info(
                "scale-out to %d: %s; their placement groups are reserved (the demand Ray's "
                "autoscaler sees) and wait up to %g s (ray.scale_out_wait_s) for Ray to place "
                "them; the deployment serves meanwhile",
                size,
                self.placement.describe_shortfall(len(indices)),
                wait_s,
            )
        start = time.monotonic()
        try:
            await self.placement.reserve(indices, wait_s or self._placement_timeout())
        except RuntimeError as error:
            if not wait_s:
                raise ValueError(f"data_parallel_size {size}: {error}") from None
            raise ValueError(
                f"data_parallel_size {size}: the Ray cluster did not grow to place "
                f"{len(indices)} more replica(s) within ray.scale_out_wait_s ({wait_s:g} s): "
                f"{error}"
            ) from None
        if wait_s:
            logger.info(
                "scale-out to %d: Ray placed the new replicas' bundles after %.1f s",
                size,
                time.monotonic() - start,
            )

    def _placement_timeout(self) -> float:
        """How long Ray may take to place bundles that fit the cluster now (``num_placeable``
        counts its totals, so a node's leftovers may not hold one): ``PLACEMENT_TIMEOUT_S``,
        or ``ray.scale_out_wait_s`` if longer on a cluster that can grow."""
        if not self.can_grow:
            return PLACEMENT_TIMEOUT_S
        return max(PLACEMENT_TIMEOUT_S, self.config.ray.scale_out_wait_s)

    async def _join(self, index: int) -> None:
        """Warm replica ``index`` from its node's disk, then from its peers across nodes (one
        budget for both), then route to it."""
        replica = self.membership.replicas[index]
        budget_s = self.config.server.warm_start_budget_s
        start = time.monotonic()
        if self.has_disk and budget_s > 0:
            try:
                num_loaded = await replica.warm_from_disk.remote(budget_s)
                logger.info("scale-out: replica %d loaded %d disk blocks", index, num_loaded)
            except (*ACTOR_LOST, RayTaskError) as error:  # a cold start still serves
                logger.warning("scale-out: replica %d did not warm up: %s", index, error)
        if has_peer_tier(self.config):
            peers = {i: self.membership.replicas[i] for i in self._serving_peers(index)}
            left_s = budget_s - (time.monotonic() - start)
            await peer_handover.warm_new_replica(replica, index, peers, left_s)
            if peers and self.config.routing.peer_pull_min_blocks:
                await peer_handover.time_pulls(replica, index, next(iter(peers.values())))
        incarnation = await replica.ready.remote()
        self.health.add(index, replica, incarnation)
        self.membership.start_serving(index)
        await self.router.start_routing.remote(index)

    async def _abandon(self, indices: list[int]) -> None:
        """New replicas that failed to start: killed and retired (their indices not reused)."""
        members = self.membership
        for index in indices:
            self._kill(members.replicas[index])
            self.health.retire(index)
            members.retire(index)
            self.placement.release(index)
            if members.node_ids[index]:  # the router heard of it
                await self.router.retire.remote(index)
        self._set_size(members.target_size - len(indices))

    def _serving_peers(self, index: int) -> list[int]:
        """The live serving replicas other than ``index``."""
        serving = self.membership.with_role(ReplicaRole.SERVING)
        return sorted(i for i in serving if i != index and self.health.is_alive(i))

    @property
    def has_disk(self) -> bool:
        offload = self.config.scheduler.kv_offload_config
        return offload.is_active and offload.disk_path is not None

    # ---- scale-in ----------------------------------------------------------------------------
    async def _scale_in(self, num_to_remove: int, victim: str = "value") -> list[VictimChoice]:
        """Remove the ``num_to_remove`` replicas whose cached blocks the cluster misses least
        (or drawn at random), draining each first."""
        members = self.membership.members()
        values = await self._replica_values(members)
        disk_blocks = await self._disk_blocks(members) if self.has_disk else {}
        choose = choose_random_victims if victim == "random" else choose_victims
        choices = choose(values, num_to_remove, disk_blocks)
        victims = [c.replica_index for c in choices]
        for choice in choices:
            logger.info(
                "scale-in: removing replica %d (%s; losses %s)",
                choice.replica_index,
                choice.reason,
                choice.losses,
            )
        self._set_size(self.membership.target_size - num_to_remove)
        for index in victims:  # before the router hears: see cluster.dispatch
            self.membership.drain(index)
        await asyncio.gather(*(self.router.set_draining.remote(v) for v in victims))
        heirs = _heirs(victims, values) if has_peer_tier(self.config) else {}
        await asyncio.gather(*(self._drain(v, heirs.get(v)) for v in victims))
        return choices

    async def _replica_values(self, members: list[int]) -> list[ReplicaValue]:
        router = await self.router.stats.remote()
        loads = {r.replica_index: r.load_tokens for r in router.replicas}

        async def one(index: int) -> ReplicaValue:
            node, load = self.membership.node_ids[index], loads.get(index, 0)
            if not self.health.is_alive(index):  # lost: it holds nothing now
                return ReplicaValue(index, node, {}, load)
            replica = self.membership.replicas[index]
            try:
                hot = await asyncio.wait_for(replica.hot_blocks.remote(), HEALTH_TIMEOUT_S)
            except (*ACTOR_LOST, RayTaskError, TimeoutError) as error:  # its value is unknown
                logger.warning("scale-in: replica %d did not report its blocks: %r", index, error)
                return ReplicaValue(index, node, {}, load, is_reachable=False)
            return ReplicaValue(index, node, hot, load)

        return list(await asyncio.gather(*(one(i) for i in members)))

    async def _disk_blocks(self, members: list[int]) -> dict[str, set[BlockHash]]:
        """The blocks on each node's disk tier (the own slabs of its live replicas)."""
        blocks: dict[str, set[BlockHash]] = {}
        for index in members:
            if not self.health.is_alive(index):
                continue
            replica = self.membership.replicas[index]
            try:
                snapshot = await asyncio.wait_for(replica.snapshot.remote(), HEALTH_TIMEOUT_S)
            except (*ACTOR_LOST, RayTaskError, TimeoutError):  # its slab counts as not there
                continue
            node = self.membership.node_ids[index]
            blocks.setdefault(node, set()).update(snapshot.hashes(Tier.DISK))
        return blocks

    async def _drain(self, index: int, heir: int | None = None) -> None:
        """Wait for replica ``index``'s requests (shedding its waiting ones past the drain
        timeout), hand its hot blocks to survivor ``heir`` through the peer tier and write them
        to disk, then retire it."""
        members = self.membership
        replica = members.replicas[index]
        timeout_s = self.config.server.drain_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while members[index].in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if members[index].in_flight:
            try:
                num_shed = await replica.shed_waiting.remote()
                logger.info(
                    "scale-in: replica %d still busy after %g s; %d waiting requests shed to "
                    "be routed again",
                    index,
                    timeout_s,
                    num_shed,
                )
            except (*ACTOR_LOST, RayTaskError) as error:  # lost: its requests take that path
                logger.warning("scale-in: replica %d did not shed its queue: %s", index, error)
            while members[index].in_flight:  # running requests end: max_tokens bounds them
                await asyncio.sleep(DRAIN_POLL_S)
        if heir is not None and self.health.is_alive(index) and self.health.is_alive(heir):
            await peer_handover.hand_over(
                replica,
                index,
                members.replicas[heir],
                heir,
                self.config.server.warm_start_budget_s,
            )
        snapshot = None
        if self.has_disk and self.health.is_alive(index):
            try:
                budget_s = self.config.server.disk_write_budget_s
                num_written = await replica.write_hot_blocks_to_disk.remote(budget_s)
                snapshot = await replica.snapshot.remote()  # its disk blocks, for the router
                logger.info("scale-in: replica %d wrote %d blocks to disk", index, num_written)
            except (*ACTOR_LOST, RayTaskError) as error:  # what is on disk stays readable
                logger.warning("scale-in: replica %d did not write to disk: %s", index, error)
        self.health.retire(index)
        members.retire(index)
        self._kill(replica)
        await self.router.retire.remote(index, snapshot)
        self.placement.release(index)

    async def tell_router(self) -> None:
        """Tell the router (re-created at its start-up size after a restart) every replica's
        role and node."""
        nodes = [node or f"unknown-{i}" for i, node in enumerate(self.membership.node_ids)]
        await self.router.sync_members.remote(self.membership.roles(), nodes)


def _heirs(victims: list[int], values: list[ReplicaValue]) -> dict[int, int]:
    """Which survivor takes each victim's hot blocks through the peer tier: the reachable
    survivors, least loaded first, one victim each in turn."""
    survivors = sorted(
        (v for v in values if v.is_reachable and v.replica_index not in victims),
        key=lambda v: (v.load_tokens, v.replica_index),
    )
    if not survivors:
        return {}
    return {v: survivors[k % len(survivors)].replica_index for k, v in enumerate(victims)}


def _describe_bytes(num_bytes: int | None, ratio: float) -> str:
    if num_bytes:
        return f"{num_bytes / 2**30:.3g} GiB"
    return f"{ratio:g} x its NPU blocks" if ratio else "off"


def _last_line(error: BaseException) -> str:
    """The last line of a remote traceback: the exception that ended it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
