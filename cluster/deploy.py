"""Deployment on Ray: replica actors in a placement group, one router actor, and the backend
the HTTP API and the offline ``LLM`` use to reach them.

    HTTP app ──route_many()──▶ RouterActor       (not on the token path; RouterCalls)
        │                     ▲ report(events, generated, finished), fire-and-forget
        └──submit()──▶ ReplicaActor i ───────────┘
               ◀──outputs: one message per step, all of this app's requests (ReplicaLink)

``cluster.placement`` decides where the replicas run and ``cluster.health`` watches them; this
module starts the actors, wires them together and stops them; ``cluster.dispatch`` serves the
requests (routing one again when its replica is lost before it started, resuming it on another
replica when its replica is lost after it started).

``scale`` resizes the deployment while it serves (``cluster.resize``); ``cluster.membership``
keeps the replicas by index and their roles (joining, serving, draining, retired).
"""

import asyncio
import logging
import time
import warnings
from collections.abc import AsyncIterator

import ray
from ray.exceptions import RayActorError

from cluster.backend import (
    ClusterStats,
    FrontStats,
    ReplicaStats,
    ScaleResult,
)
from cluster.config import ClusterConfig
from cluster.dispatch import Dispatcher, Request
from cluster.health import ACTOR_LOST, HEALTH_TIMEOUT_S, HealthMonitor
from cluster.membership import Membership
from cluster.peer_handover import PROBE_TIMEOUT_S, has_peer_tier
from cluster.placement import can_grow, init_ray, is_embedded, place_replicas
from cluster.resize import ReplicaStartError, Resizer
from cluster.router_calls import RouterCalls
from replicas.actor import ReplicaActor
from replicas.cache_hints import CacheHints
from replicas.config import EngineConfig
from replicas.kv.capacity import deployment_host_bytes
from replicas.kv.host_memory import check_host_capacity
from replicas.kv.shared_prefixes import SharedPrefixes
from replicas.model import ModelArgs, load_model_info
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams
from router.actor import RouterActor, measured_ttft_costs
from router.config import RoutingConfig
from router.router import ReplicaRole

logger = logging.getLogger(__name__)


class RayBackend:
    """Deploys ``config`` on Ray; implements ``cluster.backend.Backend``."""

    def __init__(self, config: ClusterConfig, name: str = "strata") -> None:
        self._start_config = config
        self.name = name
        engine_config = config.engine_config()  # raises on an impossible host budget
        args, self.tokenizer = load_model_info(config.model.model, config.model.revision)
        self._args = args
        self._embedded = is_embedded(config.ray)
        can_grow_ray = can_grow(config.ray)  # a scale-out that does not fit may wait for it
        if self._embedded:  # every replica's host tier will be on this machine
            _check_host_memory(config, engine_config, args)
        init_ray(config.ray)
        size = config.data_parallel_size
        self.placement = place_replicas(config.ray, engine_config, args, size)
        engine_config = self._with_threads(engine_config)
        routing = _routing(config, engine_config)
        self._pulls_from_peers = bool(routing.peer_pull_min_blocks)  # they measure its price
        self.router = _start_router(name, size, engine_config.block_size, routing, args)
        replicas = [self._start_replica(i, engine_config) for i in range(size)]
        incarnations = self._introduce_replicas(replicas)
        self.membership = Membership(replicas, self.replica_infos)
        self.router_calls = RouterCalls(self.router)
        self.health = HealthMonitor(
            replicas,
            self.router,
            incarnations,
            on_router_restart=self._tell_router,
            router_incarnation=ray.get(self.router.ready.remote()),
        )
        self.resizer = Resizer(
            config,
            self.membership,
            self.placement,
            self.health,
            self.router,
            self._start_replica,
            lambda actor: ray.kill(actor, no_restart=True),
            self._new_engine_config,
            can_grow=can_grow_ray,
        )
        self.max_model_len = int(self.replica_infos[0]["max_model_len"])
        self.block_size = engine_config.block_size
        self.dispatcher = Dispatcher(
            self.membership,
            self.health,
            self.router_calls,
            self.block_size,
            config.server.max_resumes,
            SharedPrefixes.from_config(
                engine_config.scheduler_config.prefix_cache_config.shared_prefixes, self.tokenizer
            ),
        )
        self.model_name = config.served_model_name
        logger.info("deployed %d replicas of %s: %s", size, config.model.model, self.replica_infos)

    def _with_threads(self, engine_config: EngineConfig) -> EngineConfig:
        """One torch thread per reserved CPU: replicas sharing a node must not oversubscribe
        it."""
        threads = max(1, int(self.placement.num_cpus))
        logger.info(
            "each of %d replicas reserves %g CPUs%s and computes with %d torch threads%s",
            self._start_config.data_parallel_size,
            self.placement.num_cpus,
            f" and {self.placement.num_gpus:g} GPUs" if self.placement.num_gpus else "",
            threads,
            ""
            if self._start_config.ray.cpus_per_replica is not None
            else " (ray.cpus_per_replica unset: the available CPUs shared among the replicas)",
        )
        return self.placement.pinned(engine_config).model_copy(update={"num_threads": threads})

    def _introduce_replicas(self, replicas: list[ray.actor.ActorHandle]) -> list[str]:
        """Wait for the replicas to start, tell the router what it needs of them (their
        nodes, their measured step costs for the ttft profile); their incarnations."""
        try:
            self.replica_infos = ray.get([replica.info.remote() for replica in replicas])
        except RayActorError as error:
            for actor in [*replicas, self.router]:
                ray.kill(actor, no_restart=True)
            self.placement.remove()
            raise ReplicaStartError(f"a replica could not start: {_last_line(error)}") from None
        if self._start_config.routing.needs_ttft_costs:
            measured = ray.get([replica.step_costs.remote() for replica in replicas])
            costs = measured_ttft_costs(measured)
            ray.get(self.router.set_ttft_costs.remote(costs))
            logger.info("the ttft profile prices with the replicas' measured costs: %s", costs)
        # Replicas of one node read each other's disk blocks: the router credits them all.
        ray.get(self.router.set_nodes.remote([str(i["node_id"]) for i in self.replica_infos]))
        if self._pulls_from_peers and has_peer_tier(self._start_config) and len(replicas) > 1:
            _probe_peers(replicas)
        return ray.get([replica.ready.remote() for replica in replicas])

    @property
    def replicas(self) -> list[ray.actor.ActorHandle]:
        """Every replica actor by replica index (retired ones included: see ``membership``)."""
        return self.membership.replicas

    @property
    def links(self) -> list:
        """Each replica's ``ReplicaLink``, by replica index."""
        return self.membership.links

    # ---- serving (cluster.dispatch) ---------------------------------------------------------
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        cache_hints: CacheHints | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, kept going through replica losses (``Dispatcher.generate``)."""
        request = Request(request_id, prompt_token_ids, cache_salt, cache_hints)
        return self.dispatcher.generate(request, sampling_params)

    async def abort(self, request_id: str) -> None:
        self.dispatcher.abort(request_id)

    def __getattr__(self, name: str) -> int:
        """``num_rerouted``, ``num_overload_reroutes`` and ``num_resumed``, which are
        ``dispatcher.counts``' now: still read here, with a ``DeprecationWarning``, until the
        next release."""
        if name in _MOVED_COUNTS:
            warnings.warn(
                f"RayBackend.{name} is deprecated; read RayBackend.dispatcher.counts.{name}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(self.__dict__["dispatcher"].counts, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    async def num_live_replicas(self) -> int:
        self.health.ensure_running()
        return self.health.num_live

    async def stats(self) -> ClusterStats:
        router = await self.router.stats.remote()
        loads = {r.replica_index: r for r in router.replicas}

        async def one(i: int) -> ReplicaStats:
            routed = loads.get(i)
            load = (routed.load_tokens, routed.queued_tokens) if routed is not None else (0, 0)
            try:
                engine = await asyncio.wait_for(self.replicas[i].stats.remote(), HEALTH_TIMEOUT_S)
                return ReplicaStats(i, self.health.is_alive(i), engine, *load)
            except (*ACTOR_LOST, TimeoutError):
                return ReplicaStats(i, False, None, *load)

        replicas = await asyncio.gather(*(one(i) for i in self.membership.members()))
        return ClusterStats(
            list(replicas),
            router,
            self.front_stats(),
            num_target_replicas=self.membership.target_size,
            num_scale_events=dict(self.resizer.num_scale_events),
        )

    def front_stats(self) -> FrontStats:
        counts = self.dispatcher.counts
        return FrontStats(
            num_routes=counts.num_routes,
            num_route_calls=self.router_calls.num_route_calls,
            route_seconds=counts.route_seconds,
            num_stream_messages=sum(link.num_messages for link in self.links),
            num_stream_items=sum(link.num_items for link in self.links),
            stream_seconds=sum(link.seconds for link in self.links),
            num_resumed=counts.num_resumed,
        )

    # ---- admin -------------------------------------------------------------------------------
    async def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget the cached blocks of every live replica in ``tier`` ("all", "npu", "host",
        "disk"); the router hears of it through the replicas' KV events. A lost replica comes
        back empty."""
        live = [self.replicas[i] for i in self.membership.members() if self.health.is_alive(i)]
        await asyncio.gather(*(replica.reset_prefix_cache.remote(tier) for replica in live))

    async def check_integrity(self) -> list[dict[str, int]]:
        """Every member replica's integrity check (raises if one fails) and the blocks it has
        in use, in replica-index order."""
        members = [self.replicas[i] for i in self.membership.members()]
        return list(await asyncio.gather(*(r.check_integrity.remote() for r in members)))

    # ---- resizing (cluster.resize) -----------------------------------------------------------
    async def scale(self, data_parallel_size: int, victim: str = "value") -> ScaleResult:
        """Resize to ``data_parallel_size`` replicas while serving (``cluster.resize``). Raises
        ``ValueError`` naming why for a bad size, leaving the deployment as it was; calls run
        one at a time. ``victim="random"`` removes random replicas (a benchmark baseline)."""
        self.health.ensure_running()
        return await self.resizer.scale(data_parallel_size, victim)

    def num_replicas(self) -> int:
        """The size asked for last: replicas live or starting."""
        return self.membership.target_size

    @property
    def config(self) -> ClusterConfig:
        """The config in effect (its ``data_parallel_size`` follows each resize)."""
        return self.resizer.config

    def _start_replica(self, index: int, engine_config: EngineConfig) -> ray.actor.ActorHandle:
        """Replica actor ``index`` in the bundle ``placement`` gave it."""
        config = self._start_config
        return (
            ray.remote(ReplicaActor)
            .options(
                name=f"{self.name}-replica-{index}",
                max_restarts=config.ray.replica_max_restarts,
                max_task_retries=0,
                **self.placement.actor_options(index),
            )
            .remote(
                index,
                engine_config,
                self.router,
                config.server.max_waiting_requests,
                measure_costs=config.routing.needs_ttft_costs or self._pulls_from_peers,
            )
        )

    def _new_engine_config(self, config: ClusterConfig, num_new: int) -> EngineConfig:
        """A replica added by a scale-out to ``config``'s size: the host and disk budgets
        divided by the new size (running replicas keep their shares), the threads of the
        start-up bundle. Raises ``ValueError`` when a share holds no block or, on an embedded
        Ray, the new host tiers do not fit in this machine's memory."""
        engine_config = self.placement.pinned(config.engine_config())
        if self._embedded:
            total = deployment_host_bytes(self._args, engine_config, 1) * num_new
            if total:
                check_host_capacity(total, f"host KV tier of {num_new} more replica(s)")
        threads = max(1, int(self.placement.num_cpus))
        return engine_config.model_copy(update={"num_threads": threads})

    async def _tell_router(self) -> None:
        await self.resizer.tell_router()

    def shutdown(self) -> None:
        self.health.stop()
        self._release()

    def _release(self) -> None:
        retired = self.membership.with_role(ReplicaRole.RETIRED)
        for actor in [r for i, r in enumerate(self.replicas) if i not in retired]:
            ray.kill(actor, no_restart=True)
        ray.kill(self.router, no_restart=True)
        self.placement.remove()


_MOVED_COUNTS = ("num_rerouted", "num_overload_reroutes", "num_resumed")


def _check_host_memory(config: ClusterConfig, engine_config: EngineConfig, args: ModelArgs) -> None:
    """Fail before Ray starts if the host tiers of all replicas cannot fit in this machine's
    available memory (each replica checks its own share again when it allocates it)."""
    total = deployment_host_bytes(args, engine_config, config.data_parallel_size)
    if total:
        check_host_capacity(total, f"host KV tier of {config.data_parallel_size} replica(s)")


def _probe_peers(replicas: list[ray.actor.ActorHandle]) -> None:
    """Each replica in turn times pulls from the next one (``ReplicaActor.probe_peer``; one at a
    time, so that no probe competes with another), so that the router prices the first pulls
    with measured costs rather than the peer tier's assumed rate; a probe that fails leaves
    that replica's assumption, with a warning."""
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    failed = []
    for i, replica in enumerate(replicas):
        probe = replica.probe_peer.remote(replicas[(i + 1) % len(replicas)])
        try:
            if not ray.get(probe, timeout=max(0.0, deadline - time.monotonic())):
                failed.append(i)
        except Exception as error:  # a replica that fails here fails its readiness check next
            logger.warning("replica %d could not time a pull: %s", i, _last_line(error))
    if failed:
        logger.warning("replicas %s could not time a pull from their peer", failed)


def _last_line(error: Exception) -> str:
    """The last line of a remote traceback: the exception that ended it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _start_router(
    name: str, size: int, block_size: int, routing: RoutingConfig, args: ModelArgs
) -> ray.actor.ActorHandle:
    """The deployment's router actor (restarted by Ray if it dies)."""
    return (
        ray.remote(RouterActor)
        .options(name=f"{name}-router", num_cpus=0, max_restarts=-1, max_task_retries=-1)
        .remote(
            size,
            block_size,
            routing,
            replica_name_prefix=name,
            sliding_window=args.sliding_window if "sliding" in args.layer_types else None,
        )
    )


def _routing(config: ClusterConfig, engine_config: EngineConfig) -> RoutingConfig:
    """The router's config: it names peer sources only for replicas with the peer tier."""
    offload = engine_config.scheduler_config.kv_offload_config
    min_blocks = config.routing.peer_pull_min_blocks
    if "peer" in offload.backing_options() and min_blocks:
        logger.info(
            "router: a replica holding %d or more blocks (%d tokens) more of a prompt than the "
            "chosen one is named to pull them from when the pull beats recompute at the costs "
            "each replica measures and reports (router.peer_sources)",
            min_blocks,
            min_blocks * engine_config.block_size,
        )
        return config.routing
    return config.routing.model_copy(update={"peer_pull_min_blocks": 0})
