"""Sending a request to a replica and keeping it going: routing, routing again, waiting for a
router behind the deployment, and resuming on another replica.

One request's life, as the ``Dispatcher`` runs it::

    ┌─▶ route ──▶ run on the replica ──▶ done
    │     │              │
    │     │ names a replica the deployment does not send to (draining, retired, lost):
    │     │ the router is behind; asked again (``RouterCatchUp``), not an attempt
    │     │              │
    │     │              ├─ turned away (its waiting queue full): offered to the next best
    │     │              ├─ lost or shed by a drain before any output: routed again
    │     │              └─ lost after output: resumed elsewhere from what was sent
    └─────┴────────────── (``Failure``), at most ``max_resumes`` resumes

A run's progress is a ``RunState``; what a failure means for the request, a ``Failure``. The
replicas, their roles and their links are ``cluster.membership``'s; the router is reached
through ``cluster.router_calls``; which replica is alive, through ``cluster.health``.
"""

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayTaskError

from cluster.backend import NoLiveReplicaError, OverloadedError, ReplicaFailedError
from cluster.health import ACTOR_LOST, HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S
from cluster.membership import Membership
from cluster.replica_link import StreamLostError
from replicas.actor import ReplicaUnavailableError
from replicas.cache_hints import CacheHints, PeerSource
from replicas.engine.async_engine import EngineDeadError
from replicas.kv.hashing import BlockHash
from replicas.kv.shared_prefixes import NO_SHARED_PREFIXES, SharedPrefixes
from replicas.outputs import RequestOutput
from replicas.resume import resumed_params
from replicas.sampling_params import SamplingParams
from router.policies import RouteDecision
from router.router import ReplicaRole

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


class RunState(enum.Enum):
    """How far one run of a request on one replica got."""

    QUEUED = "queued"  # sent, no output yet
    STREAMING = "streaming"  # outputs arrived
    FINISHED = "finished"  # the last output arrived


class Failure(enum.Enum):
    """What a failed run leaves to do (``Dispatcher._after_failure``); any other outcome ends
    the request with an error."""

    TURNED_AWAY = "turned away"  # the replica's waiting queue was full: offer it elsewhere
    ROUTE_AGAIN = "route again"  # lost, or shed by a drain, before any output


class LostMidStream(ReplicaFailedError):
    """The replica serving a request was lost after the request's first output."""


REPLICA_ERRORS = (
    RayTaskError,
    *ACTOR_LOST,
    StreamLostError,
    EngineDeadError,
    ValueError,
    ReplicaUnavailableError,  # a draining replica shed the request before it started
)
"""What a replica link raises for a request (``ReplicaLink.generate``)."""


@dataclass(slots=True)
class Request:
    """What the dispatcher keeps of a request to run it again, and the router's release of its
    last attempt (routed again only once it is done: an async actor may run calls out of
    order)."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    cache_hints: CacheHints | None
    released: asyncio.Future | None = None


@dataclass(slots=True)
class DispatchCounts:
    """Requests the dispatcher kept going, and the time its routing took."""

    num_rerouted: int = 0  # routed again because their replica was lost first
    num_overload_reroutes: int = 0  # turned away by a full replica, offered elsewhere
    num_resumed: int = 0  # resumed elsewhere after their replica was lost mid-stream
    num_routes: int = 0
    route_seconds: float = 0.0


class Dispatcher:
    """Runs requests on the deployment's replicas (see the module docstring)."""

    def __init__(
        self,
        membership: Membership,
        health: Any,  # cluster.health.HealthMonitor
        router_calls: Any,  # cluster.router_calls.RouterCalls
        block_size: int,
        max_resumes: int,
        shared_prefixes: SharedPrefixes = NO_SHARED_PREFIXES,
    ) -> None:
        self.membership = membership
        self.health = health
        self.router_calls = router_calls
        self.block_size = block_size
        self.max_resumes = max_resumes
        self.shared_prefixes = shared_prefixes  # hashed as the replicas hash them
        self.counts = DispatchCounts()

    async def generate(
        self, request: Request, sampling_params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """A replica lost after the request's first output, when it is not the replica's
        engine that failed, is replaced: the request is resumed on the best live replica from
        the output sent so far (``replicas.resume``), at most ``max_resumes`` times; the
        outputs continue as if nothing happened. Past that, or with no live replica to take
        it, the request fails with ``ReplicaFailedError``. A prompt no replica can serve (too
        long, empty) is checked where it enters the replica it is routed to, whose
        ``ValueError`` is raised here before any output."""
        self.health.ensure_running()
        last: RequestOutput | None = None  # the last output sent, once there is one
        lost: LostMidStream | None = None  # the loss that made it resume
        num_resumes = 0
        while True:
            resuming = last is not None  # counted in num_resumed at its first output
            params = resumed_params(sampling_params, num_resumes) if resuming else sampling_params
            try:  # closed at once when the caller stops early: its finally aborts the run
                async with contextlib.aclosing(self._serve(request, params, last)) as outputs:
                    async for output in outputs:
                        if resuming:
                            self.counts.num_resumed += 1
                            resuming = False
                        last = output
                        yield output
                return
            except LostMidStream as error:
                if num_resumes >= self.max_resumes:
                    raise
                lost = error
            except (NoLiveReplicaError, OverloadedError):
                if lost is None:
                    raise  # nothing ran: the client may retry
                raise lost from None  # no live replica can take the resumed request
            num_resumes += 1
            logger.warning(
                "replica %s was lost after request %s had %d output tokens; resuming it "
                "elsewhere (resume %d of at most %d)",
                last.replica_index,
                request.request_id,
                len(last.token_ids),
                num_resumes,
                self.max_resumes,
            )

    def abort(self, request_id: str) -> None:
        for index in self.membership.members():
            self.membership[index].link.abort(request_id)

    async def _serve(
        self, request: Request, params: SamplingParams, resumed: RequestOutput | None
    ) -> AsyncIterator[RequestOutput]:
        """One run of the request to its end (continuing ``resumed``, when given). A replica
        lost before the run's first output, or turning it away because its engine failed,
        never ran it: the run is routed again, away from that replica. A replica whose waiting
        queue is full turns it away too: the router offers it to the next best replica, and
        only when every live replica is full does the client get 429. Once the run has
        output, a loss raises ``LostMidStream``. A router that names a replica the deployment
        does not send requests to (``_member_route``) is asked again without that counting as
        an attempt, for up to ``ROUTER_CATCH_UP_S``: a scale-in or a restart of the router
        fails no request."""
        token_ids = request.prompt_token_ids + (resumed.token_ids if resumed else [])
        hashes = self.shared_prefixes.hashes(token_ids, self.block_size, request.cache_salt)
        num_attempts = 2 * max(2, self.membership.num_members())
        full: set[int] = set()
        catch_up = RouterCatchUp()
        for attempt in range(num_attempts):
            is_last = attempt == num_attempts - 1
            decision = await self._member_route(
                request, len(token_ids), hashes, full, catch_up, is_last
            )
            if decision is None:  # the router stayed behind the deployment: attempt spent
                continue
            index = decision.replica_index
            member = self.membership[index]
            stream = member.link.generate(
                request.request_id,
                request.prompt_token_ids,
                params,
                request.cache_salt,
                self._hints(request, decision),
                resumed,
            )
            state = RunState.QUEUED
            member.in_flight += 1  # no await since the routable check: a drain waits for it
            try:
                async for output in stream:
                    state = RunState.FINISHED if output.finished else RunState.STREAMING
                    yield output
                return
            except REPLICA_ERRORS as error:
                if self._after_failure(error, index, state, is_last, request.request_id) is (
                    Failure.TURNED_AWAY
                ):
                    full.add(index)
                    state = RunState.FINISHED  # never queued there: nothing to abort
            finally:
                member.in_flight -= 1
                await stream.aclose()
                if state is not RunState.FINISHED:  # a restarted replica may have it queued
                    member.link.abort(request.request_id)
                request.released = self.router_calls.release(request.request_id)
        raise OverloadedError(f"replicas {sorted(full)} turned the request away; retry later")

    async def _member_route(
        self,
        request: Request,
        num_prompt_tokens: int,
        hashes: list[BlockHash],
        full: set[int],
        catch_up: "RouterCatchUp",
        is_last: bool,
    ) -> RouteDecision | None:
        """The replica the router picks (``_route``) once it is one the deployment sends
        requests to: routable (``Membership.is_routable``) and, unless ``is_last``, live as far
        as the health monitor knows. An answer naming another replica is a router behind the
        deployment: it has not heard of the drain, the retirement or the loss yet, or Ray
        restarted it and it has not been told the replicas yet. That replica is never called:
        the router is told of a loss again, and asked again after ``catch_up``'s wait. None
        once ``catch_up``'s time is spent (the caller counts the attempt)."""
        while True:
            if request.released is not None:
                await request.released
            decision = await self._route(request, num_prompt_tokens, hashes, full)
            index = decision.replica_index
            routable = self.membership.is_routable(index)
            if routable and (self.health.is_alive(index) or is_last):
                return decision  # no await from here to the call: a drain waits for it
            if routable:  # lost: told again at every sighting (a restarted router forgot it)
                self.health.mark_lost(index)
            request.released = self.router_calls.release(request.request_id)
            if not await catch_up.wait():
                return None

    def _after_failure(
        self, error: Exception, index: int, state: RunState, is_last: bool, request_id: str
    ) -> Failure:
        """What a failure of replica ``index`` in a run that got to ``state`` leaves to do;
        raises the error that ends this run of the request when it is neither."""
        cause = error.cause if isinstance(error, RayTaskError) else error
        started = state is not RunState.QUEUED
        if isinstance(cause, OverloadedError) and not started:
            self.counts.num_overload_reroutes += 1
            return Failure.TURNED_AWAY
        if isinstance(cause, (ValueError, EngineDeadError)) or (
            isinstance(error, RayTaskError) and not isinstance(cause, ReplicaUnavailableError)
        ):
            raise _unwrap(cause, index) from None
        if self.membership[index].role is ReplicaRole.DRAINING and not started and not is_last:
            self.counts.num_rerouted += 1  # shed by a drain before it started: it runs elsewhere
            logger.info("request %s left draining replica %d; routing it again", request_id, index)
            return Failure.ROUTE_AGAIN
        self.health.mark_lost(index)
        message = f"replica {index} failed while serving the request: {type(error).__name__}"
        if started:
            raise LostMidStream(message) from None
        if is_last:
            raise ReplicaFailedError(message) from None
        self.counts.num_rerouted += 1
        logger.warning(
            "replica %d was lost before request %s started; routing it again", index, request_id
        )
        return Failure.ROUTE_AGAIN

    async def _route(
        self, request: Request, num_prompt_tokens: int, hashes: list[BlockHash], full: set[int]
    ) -> RouteDecision:
        """The router's decision: a replica not one of ``full`` (their waiting queues turned the
        request away) nor a draining one. Calls to a router that Ray is restarting wait for it
        (``max_task_retries=-1``) rather than fail."""
        start = time.perf_counter()
        key = request.cache_hints.key if request.cache_hints is not None else None
        draining = self.membership.with_role(ReplicaRole.DRAINING)
        try:
            decision = await self.router_calls.route(
                request.request_id, num_prompt_tokens, hashes, full | draining, key
            )
        except NoLiveReplicaError:
            if full:
                raise OverloadedError(
                    f"every live replica ({len(full)}) has a full waiting queue; retry later"
                ) from None
            raise
        finally:
            self.counts.num_routes += 1
            self.counts.route_seconds += time.perf_counter() - start
        return decision

    def _hints(self, request: Request, decision: RouteDecision) -> CacheHints | None:
        """The request's cache hints, with the source the router named to pull the prompt's
        prefix from (``replicas.kv.tiers.peer``) while that replica is routable and alive."""
        source = decision.peer_source
        if source is None or not (
            self.membership.is_routable(source) and self.health.is_alive(source)
        ):
            return request.cache_hints
        peer = PeerSource(source, self.membership[source].replica, decision.num_peer_tokens)
        return dataclasses.replace(request.cache_hints or CacheHints(), peer=peer)


class RouterCatchUp:
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


def _unwrap(cause: BaseException, index: int) -> Exception:
    if isinstance(cause, OverloadedError):
        return OverloadedError(str(cause))
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    return ReplicaFailedError(f"replica {index} failed: {cause!r}")
