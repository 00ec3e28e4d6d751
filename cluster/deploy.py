"""Deployment on Ray: replica actors in a placement group, one router actor, and the backend
the HTTP API and the offline ``LLM`` use to reach them.

    HTTP app ──route()──▶ RouterActor            (not on the token path)
        │                     ▲ report(events, generated, finished), fire-and-forget
        └──generate()──▶ ReplicaActor i ─────────┘   streams outputs back to the app

A health monitor pings every replica; a replica that fails to answer is dropped from routing,
and one that answers with a new incarnation id (Ray restarted it) rejoins with an empty cache.
"""

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.backend import (
    ClusterStats,
    NoLiveReplicaError,
    OverloadedError,
    ReplicaFailedError,
    ReplicaStats,
)
from cluster.capacity import host_bytes_total, kv_block_bytes
from cluster.config import ClusterConfig, RayConfig
from replicas.actor import ReplicaActor, ReplicaOverloadedError, ReplicaUnavailableError
from replicas.config import EngineConfig
from replicas.hashing import BlockHash, block_hashes
from replicas.host_memory import check_host_capacity
from replicas.model import ModelArgs, load_model_info
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams
from router.actor import RouterActor
from router.router import NoLiveReplicaError as RouterNoLiveReplicaError

logger = logging.getLogger(__name__)

_ACTOR_LOST = (RayActorError, ActorUnavailableError)
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 10.0


def init_ray(config: RayConfig) -> None:
    """Join ``config.address``, or start an embedded local Ray sized for this machine: always a
    new instance (``address="local"``), never a head that happens to run here already."""
    if ray.is_initialized():
        return
    if config.address:
        ray.init(address=config.address, namespace=config.namespace, log_to_driver=True)
    else:
        ray.init(
            address="local",
            num_cpus=config.num_cpus or os.cpu_count(),
            namespace=config.namespace,
            include_dashboard=False,
            log_to_driver=True,
        )


def _gpus_per_replica(ray_config: RayConfig, device: str, size: int) -> float:
    """``ray.gpus_per_replica``, or when unset: one GPU per replica if the cluster has one for
    each and the device allows CUDA, else none."""
    if ray_config.gpus_per_replica is not None:
        return ray_config.gpus_per_replica
    if device == "cpu" or ray.cluster_resources().get("GPU", 0) < size:
        return 0.0
    logger.info("the Ray cluster has a GPU for each of %d replicas: one GPU per replica", size)
    return 1.0


class RayBackend:
    """Deploys ``config`` on Ray; implements ``cluster.backend.Backend``."""

    def __init__(self, config: ClusterConfig, name: str = "strata") -> None:
        self.config = config
        self.name = name
        engine_config = config.engine_config()  # raises on an impossible host budget
        # One torch thread per reserved CPU: replicas sharing a node must not oversubscribe it.
        threads = max(1, int(config.ray.cpus_per_replica))
        engine_config = engine_config.model_copy(update={"num_threads": threads})
        args, self.tokenizer = load_model_info(config.model.model, config.model.revision)
        if _is_embedded(config.ray):  # every replica's host tier will be on this machine
            _check_host_memory(config, engine_config, args)
        init_ray(config.ray)
        ray_config = config.ray
        size = config.data_parallel_size
        bundle = {"CPU": ray_config.cpus_per_replica, **ray_config.resources_per_replica}
        gpus_per_replica = _gpus_per_replica(ray_config, engine_config.device, size)
        if gpus_per_replica:
            bundle["GPU"] = gpus_per_replica
        elif engine_config.device == "auto" and ray.cluster_resources().get("GPU"):
            logger.warning(
                "the Ray cluster has GPUs but no replica reserves one (ray.gpus_per_replica): "
                "replicas run on the CPU (a replica uses a GPU only when its placement bundle "
                "reserves one)"
            )
        self.placement_group = placement_group(
            [dict(bundle)] * size, strategy=ray_config.placement_strategy
        )
        try:
            ray.get(self.placement_group.ready(), timeout=120)
        except GetTimeoutError as error:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"cannot place {size} replicas needing {bundle} each on this Ray cluster "
                f"({ray.cluster_resources()}); lower data_parallel_size or ray.cpus_per_replica"
            ) from error
        self.router = (
            ray.remote(RouterActor)
            .options(
                name=f"{name}-router",
                num_cpus=0,
                max_restarts=-1,
                max_task_retries=-1,
            )
            .remote(size, engine_config.block_size, config.routing, replica_name_prefix=name)
        )
        replica_cls = ray.remote(ReplicaActor)
        self.replicas = [
            replica_cls.options(
                name=f"{name}-replica-{i}",
                num_cpus=ray_config.cpus_per_replica,
                num_gpus=gpus_per_replica,
                resources=ray_config.resources_per_replica,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i),
                max_restarts=ray_config.replica_max_restarts,
                max_task_retries=0,
            ).remote(i, engine_config, self.router, config.server.max_waiting_requests)
            for i in range(size)
        ]
        try:
            self.replica_infos = ray.get([replica.info.remote() for replica in self.replicas])
        except RayActorError as error:
            self._monitor = None
            self.shutdown()
            raise ReplicaStartError(f"a replica could not start: {_last_line(error)}") from None
        infos = self.replica_infos
        self.incarnations: list[str | None] = ray.get([r.ready.remote() for r in self.replicas])
        self.alive = [True] * size
        self.num_rerouted = 0  # requests routed again because their replica was lost first
        self.max_model_len = int(infos[0]["max_model_len"])
        self.block_size = engine_config.block_size
        self.model_name = config.served_model_name
        self._monitor: asyncio.Task | None = None
        logger.info("deployed %d replicas of %s: %s", size, config.model.model, infos)

    # ---- serving -----------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self._ensure_monitor()
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}: it must be shorter, leaving room for one output token"
            )
        hashes = block_hashes(prompt_token_ids, self.block_size, cache_salt)
        # A replica lost before the request's first output, or turning it away because its
        # engine failed, never ran it: the request is routed again, away from that replica.
        # Once outputs have reached the client, a loss fails the request.
        num_attempts = 2 * len(self.replicas)
        for attempt in range(num_attempts):
            is_last = attempt == num_attempts - 1
            index = await self._route(request_id, len(prompt_token_ids), hashes)
            if not (self.alive[index] or is_last):
                # The router has not heard of the loss yet (one that Ray restarted believes every
                # replica live): tell it again and route again, before any call to the replica.
                self._lost(index)
                self.router.release.remote(request_id)
                continue
            stream = (
                self.replicas[index]
                .generate.options(num_returns="streaming")
                .remote(request_id, prompt_token_ids, sampling_params, cache_salt)
            )
            started = finished = lost = False
            try:
                async for ref in stream:
                    output = await ref
                    started, finished = True, output.finished
                    yield output
                return
            except (RayTaskError, *_ACTOR_LOST) as error:
                unavailable = isinstance(getattr(error, "cause", None), ReplicaUnavailableError)
                if isinstance(error, RayTaskError) and not unavailable:
                    raise _unwrap(error, index) from None
                lost = True
                self._lost(index)
                if started or is_last:
                    raise ReplicaFailedError(
                        f"replica {index} failed while serving the request: {type(error).__name__}"
                    ) from None
                self.num_rerouted += 1
                logger.warning(
                    "replica %d was lost before request %s started; routing it again",
                    index,
                    request_id,
                )
            finally:
                if not (finished or lost):
                    self.replicas[index].abort.remote(request_id)
                self.router.release.remote(request_id)  # before a new route() of the same id

    async def _route(self, request_id: str, num_prompt_tokens: int, hashes: list[BlockHash]) -> int:
        """The replica the router picks. Calls to a router that Ray is restarting wait for it
        (``max_task_retries=-1``) rather than fail."""
        try:
            decision = await self.router.route.remote(request_id, num_prompt_tokens, hashes)
        except RayTaskError as error:
            if isinstance(error.cause, RouterNoLiveReplicaError):
                raise NoLiveReplicaError(str(error.cause)) from None
            raise
        return decision.replica_index

    async def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            replica.abort.remote(request_id)

    async def num_live_replicas(self) -> int:
        self._ensure_monitor()
        return sum(self.alive)

    async def stats(self) -> ClusterStats:
        async def one(i: int) -> ReplicaStats:
            try:
                engine = await asyncio.wait_for(self.replicas[i].stats.remote(), HEALTH_TIMEOUT_S)
                return ReplicaStats(i, self.alive[i], engine)
            except (*_ACTOR_LOST, asyncio.TimeoutError):
                return ReplicaStats(i, False, None)

        replicas = await asyncio.gather(*(one(i) for i in range(len(self.replicas))))
        router = await self.router.stats.remote()
        return ClusterStats(list(replicas), router)

    # ---- health ------------------------------------------------------------------------------
    def _ensure_monitor(self) -> None:
        loop = asyncio.get_running_loop()
        if self._monitor is None or self._monitor.done() or self._monitor.get_loop() is not loop:
            self._monitor = loop.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(i) for i in range(len(self.replicas))))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _check(self, index: int) -> None:
        try:
            incarnation = await asyncio.wait_for(
                self.replicas[index].ready.remote(), HEALTH_TIMEOUT_S
            )
        except (*_ACTOR_LOST, RayTaskError, asyncio.TimeoutError):  # a failed engine raises
            self._lost(index)
            return
        if not self.alive[index] or incarnation != self.incarnations[index]:
            logger.warning(
                "replica %d is back (incarnation %s); it rejoins routing", index, incarnation
            )
            self.incarnations[index] = incarnation
            self.alive[index] = True
            await self.router.mark_alive.remote(index)

    def _lost(self, index: int) -> None:
        if self.alive[index]:
            logger.warning("replica %d is unreachable; removing it from routing", index)
            self.alive[index] = False
        # Told every time (idempotent): a router that Ray restarted believes every replica live.
        self.router.mark_dead.remote(index)

    # ---- admin -------------------------------------------------------------------------------
    def check_integrity(self) -> list[dict[str, int]]:
        return ray.get([replica.check_integrity.remote() for replica in self.replicas])

    def shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for actor in [*self.replicas, self.router]:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.placement_group)


class ReplicaStartError(RuntimeError):
    """A replica actor failed in its constructor; the deployment was torn down."""


def _is_embedded(config: RayConfig) -> bool:
    """Whether ``init_ray`` will start a Ray instance on this machine (no cluster to join)."""
    return not (config.address or ray.is_initialized())


def _check_host_memory(config: ClusterConfig, engine_config: EngineConfig, args: ModelArgs) -> None:
    """Fail before Ray starts if the host tiers of all replicas cannot fit in this machine's
    available memory (each replica checks its own share again when it allocates it)."""
    block_bytes = kv_block_bytes(args, engine_config.block_size, engine_config.dtype)
    num_npu_blocks = engine_config.num_npu_blocks or engine_config.npu_kv_memory_bytes // max(
        1, block_bytes
    )
    total = host_bytes_total(
        config.scheduler.kv_offload_config, config.data_parallel_size, num_npu_blocks, block_bytes
    )
    if total:
        check_host_capacity(total, f"host KV tier of {config.data_parallel_size} replica(s)")


def _last_line(error: Exception) -> str:
    """The last line of a remote traceback: the exception that ended it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _unwrap(error: RayTaskError, index: int) -> Exception:
    cause = error.cause
    if isinstance(cause, ReplicaOverloadedError):
        return OverloadedError(str(cause))
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    return ReplicaFailedError(f"replica {index} failed: {cause!r}")
