"""Deployment on Ray: replica actors in a placement group, one router actor, and the backend
the HTTP API and the offline ``LLM`` use to reach them.

    HTTP app ──route_many()──▶ RouterActor       (not on the token path; RouterCalls)
        │                     ▲ report(events, generated, finished), fire-and-forget
        └──submit()──▶ ReplicaActor i ───────────┘
               ◀──outputs: one message per step, all of this app's requests (ReplicaLink)

``cluster.placement`` decides where the replicas run and ``cluster.health`` watches them; this
module wires the actors together and serves requests, routing one again when its replica is
lost before it started, and resuming it on another replica when its replica is lost after it
started (``replicas.resume``).

``scale`` resizes the deployment while it serves (``cluster.resize``); ``cluster.membership``
keeps the replicas by index and their roles (joining, serving, draining, retired).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError, RayTaskError

from cluster.backend import (
    ClusterStats,
    FrontStats,
    NoLiveReplicaError,
    OverloadedError,
    ReplicaFailedError,
    ReplicaStats,
    ScaleResult,
)
from cluster.config import ClusterConfig
from cluster.health import ACTOR_LOST, HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S, HealthMonitor
from cluster.membership import Membership
from cluster.placement import init_ray, is_embedded, place_replicas
from cluster.replica_link import StreamLostError
from cluster.resize import ReplicaStartError, Resizer
from cluster.router_calls import RouterCalls
from replicas.actor import ReplicaActor, ReplicaUnavailableError
from replicas.cache_hints import CacheHints
from replicas.config import EngineConfig
from replicas.engine.async_engine import EngineDeadError
from replicas.kv.capacity import deployment_host_bytes
from replicas.kv.hashing import BlockHash, block_hashes
from replicas.kv.host_memory import check_host_capacity
from replicas.model import ModelArgs, load_model_info
from replicas.outputs import RequestOutput
from replicas.prompt import check_prompt_length
from replicas.resume import resumed_params
from replicas.sampling_params import SamplingParams
from router.actor import RouterActor, measured_ttft_costs

logger = logging.getLogger(__name__)

ROUTER_CATCH_UP_S = HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S
"""How long one run of a request keeps asking the router again while it names replicas the
deployment does not send requests to (draining, retired or lost), before such an answer counts
as an attempt. The router hears of a drain, a retirement or a loss just after the deployment;
a router that Ray restarted (at its start-up size, every start-up replica serving) is told the
deployment's replicas within one round of the health monitor's pings (``cluster.health``)."""
STALE_ROUTE_WAIT_S = 0.01
"""The wait before asking the router again after its second such answer; it doubles with each
answer after, up to ``STALE_ROUTE_MAX_WAIT_S``. The first is asked again at once: the route was
most likely sent before the router heard of the change."""
STALE_ROUTE_MAX_WAIT_S = 0.25


class RayBackend:
    """Deploys ``config`` on Ray; implements ``cluster.backend.Backend``."""

    def __init__(self, config: ClusterConfig, name: str = "strata") -> None:
        self._start_config = config
        self.name = name
        engine_config = config.engine_config()  # raises on an impossible host budget
        args, self.tokenizer = load_model_info(config.model.model, config.model.revision)
        self._args = args
        self._embedded = is_embedded(config.ray)
        if self._embedded:  # every replica's host tier will be on this machine
            _check_host_memory(config, engine_config, args)
        init_ray(config.ray)
        size = config.data_parallel_size
        self.placement = place_replicas(config.ray, engine_config, args, size)
        engine_config = self._with_threads(engine_config)
        self.router = (
            ray.remote(RouterActor)
            .options(name=f"{name}-router", num_cpus=0, max_restarts=-1, max_task_retries=-1)
            .remote(
                size,
                engine_config.block_size,
                config.routing,
                replica_name_prefix=name,
                sliding_window=args.sliding_window if "sliding" in args.layer_types else None,
            )
        )
        replicas = [self._start_replica(i, engine_config) for i in range(size)]
        incarnations = self._introduce_replicas(replicas)
        self.membership = Membership(replicas, self.replica_infos)
        self.router_calls = RouterCalls(self.router)
        self._num_routes = 0
        self._route_seconds = 0.0
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
        )
        self.num_rerouted = 0  # requests routed again because their replica was lost first
        self.num_overload_reroutes = 0  # requests a full replica turned away, offered elsewhere
        self.num_resumed = 0  # requests resumed elsewhere after their replica was lost
        self.max_resumes = config.server.max_resumes
        self.max_model_len = int(self.replica_infos[0]["max_model_len"])
        self.block_size = engine_config.block_size
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
        return ray.get([replica.ready.remote() for replica in replicas])

    @property
    def replicas(self) -> list[ray.actor.ActorHandle]:
        """Every replica actor by replica index (retired ones included: see ``membership``)."""
        return self.membership.replicas

    @property
    def links(self) -> list:
        """Each replica's ``ReplicaLink``, by replica index."""
        return self.membership.links

    # ---- serving -----------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        cache_hints: CacheHints | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """A replica lost after the request's first output, when it is not the replica's
        engine that failed, is replaced: the request is resumed on the best live replica from
        the output sent so far (``replicas.resume``), at most ``max_resumes`` times; the
        outputs continue as if nothing happened. Past that, or with no live replica to take
        it, the request fails with ``ReplicaFailedError``."""
        self.health.ensure_running()
        check_prompt_length(len(prompt_token_ids), self.max_model_len)  # before routing
        request = _Request(request_id, prompt_token_ids, cache_salt, cache_hints)
        last: RequestOutput | None = None  # the last output sent, once there is one
        lost: _LostMidStream | None = None  # the loss that made it resume
        num_resumes = 0
        counted = True  # the current run is counted in num_resumed (or is not a resume)
        while True:
            params = (
                sampling_params if last is None else resumed_params(sampling_params, num_resumes)
            )
            try:  # closed at once when the caller stops early: its finally aborts the run
                async with contextlib.aclosing(self._serve(request, params, last)) as outputs:
                    async for output in outputs:
                        if last is not None and not counted:  # a resumed run goes on
                            self.num_resumed += 1
                            counted = True
                        last = output
                        yield output
                return
            except _LostMidStream as error:
                if num_resumes >= self.max_resumes:
                    raise
                lost = error
            except (NoLiveReplicaError, OverloadedError):
                if lost is None:
                    raise  # nothing ran: the client may retry
                raise lost from None  # no live replica can take the resumed request
            num_resumes += 1
            counted = False
            logger.warning(
                "replica %s was lost after request %s had %d output tokens; resuming it "
                "elsewhere (resume %d of at most %d)",
                last.replica_index,
                request_id,
                len(last.token_ids),
                num_resumes,
                self.max_resumes,
            )

    async def _serve(
        self, request: "_Request", params: SamplingParams, resumed: RequestOutput | None
    ) -> AsyncIterator[RequestOutput]:
        """One run of the request to its end (continuing ``resumed``, when given). A replica
        lost before the run's first output, or turning it away because its engine failed,
        never ran it: the run is routed again, away from that replica. A replica whose waiting
        queue is full turns it away too: the router offers it to the next best replica, and
        only when every live replica is full does the client get 429. Once the run has
        output, a loss raises ``_LostMidStream``. A router that names a replica the deployment
        does not send requests to (``_member_route``) is asked again without that counting as
        an attempt, for up to ``ROUTER_CATCH_UP_S``: a scale-in or a restart of the router
        fails no request."""
        request_id = request.request_id
        token_ids = request.prompt_token_ids + (resumed.token_ids if resumed else [])
        hashes = block_hashes(token_ids, self.block_size, request.cache_salt)
        key = request.cache_hints.key if request.cache_hints is not None else None
        members = self.membership
        num_attempts = 2 * max(2, members.num_members())
        full: set[int] = set()
        catch_up = _RouterCatchUp()
        for attempt in range(num_attempts):
            is_last = attempt == num_attempts - 1
            index = await self._member_route(
                request, len(token_ids), hashes, full, key, catch_up, is_last
            )
            if index is None:  # the router stayed behind the deployment: this attempt is spent
                continue
            stream = self.links[index].generate(
                request_id,
                request.prompt_token_ids,
                params,
                request.cache_salt,
                request.cache_hints,
                resumed,
            )
            started = finished = False
            members.in_flight[index] += 1  # no await since the routable check: a drain waits
            try:
                async for output in stream:
                    started, finished = True, output.finished
                    yield output
                return
            except _REPLICA_ERRORS as error:
                finished = self._after_failure(error, index, started, is_last, request_id)
                if finished:
                    full.add(index)
            finally:
                members.in_flight[index] -= 1
                await stream.aclose()
                if not finished:  # also after a loss: a restarted replica may have it queued
                    self.replicas[index].abort.remote(request_id)
                request.released = self.router_calls.release(request_id)
        raise OverloadedError(f"replicas {sorted(full)} turned the request away; retry later")

    async def _member_route(
        self,
        request: "_Request",
        num_prompt_tokens: int,
        hashes: list[BlockHash],
        full: set[int],
        cache_key: str | None,
        catch_up: "_RouterCatchUp",
        is_last: bool,
    ) -> int | None:
        """The replica the router picks (``_route``) once it is one the deployment sends
        requests to: routable (``Membership.is_routable``) and, unless ``is_last``, live as far
        as the health monitor knows. An answer naming another replica is a router behind the
        deployment: it has not heard of the drain, the retirement or the loss yet, or Ray
        restarted it and it has not been told the replicas yet. That replica is never called:
        the router is told of a loss again, and asked again after ``catch_up``'s wait. None
        once ``catch_up``'s time is spent (the caller counts the attempt)."""
        members = self.membership
        while True:
            if request.released is not None:
                await request.released
            index = await self._route(
                request.request_id, num_prompt_tokens, hashes, full, cache_key
            )
            routable = members.is_routable(index)
            if routable and (self.health.is_alive(index) or is_last):
                return index  # no await from here to the call: a drain waits for it
            if routable:  # lost: told again at every sighting (a restarted router forgot it)
                self.health.mark_lost(index)
            request.released = self.router_calls.release(request.request_id)
            if not await catch_up.wait():
                return None

    def _after_failure(
        self, error: Exception, index: int, started: bool, is_last: bool, request_id: str
    ) -> bool:
        """What a failure of replica ``index`` does to a request: True when the replica's
        waiting queue was full (it never queued the request); False when the request is to be
        routed again; otherwise raises the error that ends this run of it."""
        cause = error.cause if isinstance(error, RayTaskError) else error
        if isinstance(cause, OverloadedError) and not started:
            self.num_overload_reroutes += 1
            return True
        if isinstance(cause, (ValueError, EngineDeadError)) or (
            isinstance(error, RayTaskError) and not isinstance(cause, ReplicaUnavailableError)
        ):
            raise _unwrap(cause, index) from None
        if index in self.membership.draining and not started and not is_last:
            self.num_rerouted += 1  # shed by a drain before it started: it runs elsewhere
            logger.info("request %s left draining replica %d; routing it again", request_id, index)
            return False
        self.health.mark_lost(index)
        message = f"replica {index} failed while serving the request: {type(error).__name__}"
        if started:
            raise _LostMidStream(message) from None
        if is_last:
            raise ReplicaFailedError(message) from None
        self.num_rerouted += 1
        logger.warning(
            "replica %d was lost before request %s started; routing it again", index, request_id
        )
        return False

    async def _route(
        self,
        request_id: str,
        num_prompt_tokens: int,
        hashes: list[BlockHash],
        full: set[int],
        cache_key: str | None = None,
    ) -> int:
        """The replica the router picks, not one of ``full`` (their waiting queues turned the
        request away). Calls to a router that Ray is restarting wait for it
        (``max_task_retries=-1``) rather than fail."""
        start = time.perf_counter()
        try:
            decision = await self.router_calls.route(
                request_id, num_prompt_tokens, hashes, full | self.membership.draining, cache_key
            )
        except NoLiveReplicaError:
            if full:
                raise OverloadedError(
                    f"every live replica ({len(full)}) has a full waiting queue; retry later"
                ) from None
            raise
        finally:
            self._num_routes += 1
            self._route_seconds += time.perf_counter() - start
        return decision.replica_index

    async def abort(self, request_id: str) -> None:
        for index in self.membership.members():
            self.replicas[index].abort.remote(request_id)

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
        return FrontStats(
            num_routes=self._num_routes,
            num_route_calls=self.router_calls.num_route_calls,
            route_seconds=self._route_seconds,
            num_stream_messages=sum(link.num_messages for link in self.links),
            num_stream_items=sum(link.num_items for link in self.links),
            stream_seconds=sum(link.seconds for link in self.links),
            num_resumed=self.num_resumed,
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
                measure_costs=config.routing.needs_ttft_costs,
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
        retired = self.membership.retired
        for actor in [r for i, r in enumerate(self.replicas) if i not in retired]:
            ray.kill(actor, no_restart=True)
        ray.kill(self.router, no_restart=True)
        self.placement.remove()


@dataclass(slots=True)
class _Request:
    """What the backend keeps of a request to run it again, and the router's release of its
    last attempt (routed again only once it is done: an async actor may run calls out of
    order)."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    cache_hints: CacheHints | None
    released: asyncio.Future | None = None


class _RouterCatchUp:
    """The waits of one run of a request while the router names replicas the deployment does
    not send requests to: none before asking again the first time, then
    ``STALE_ROUTE_WAIT_S`` doubling up to ``STALE_ROUTE_MAX_WAIT_S``, for at most
    ``ROUTER_CATCH_UP_S`` from the first such answer."""

    def __init__(self) -> None:
        self._deadline: float | None = None
        self._wait_s = 0.0

    async def wait(self) -> bool:
        """Wait before the router is asked again; False, without waiting, once the time to
        catch up is spent."""
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + ROUTER_CATCH_UP_S
        remaining = self._deadline - loop.time()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(self._wait_s, remaining))
        self._wait_s = min(max(2 * self._wait_s, STALE_ROUTE_WAIT_S), STALE_ROUTE_MAX_WAIT_S)
        return True


class _LostMidStream(ReplicaFailedError):
    """The replica serving a request was lost after the request's first output."""


_REPLICA_ERRORS = (
    RayTaskError,
    *ACTOR_LOST,
    StreamLostError,
    EngineDeadError,
    ValueError,
    ReplicaUnavailableError,  # a draining replica shed the request before it started
)
"""What a replica link raises for a request (``ReplicaLink.generate``)."""


def _check_host_memory(config: ClusterConfig, engine_config: EngineConfig, args: ModelArgs) -> None:
    """Fail before Ray starts if the host tiers of all replicas cannot fit in this machine's
    available memory (each replica checks its own share again when it allocates it)."""
    total = deployment_host_bytes(args, engine_config, config.data_parallel_size)
    if total:
        check_host_capacity(total, f"host KV tier of {config.data_parallel_size} replica(s)")


def _last_line(error: Exception) -> str:
    """The last line of a remote traceback: the exception that ended it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _unwrap(cause: BaseException, index: int) -> Exception:
    if isinstance(cause, OverloadedError):
        return OverloadedError(str(cause))
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    return ReplicaFailedError(f"replica {index} failed: {cause!r}")
