"""``RouterActor``: the ``Router`` as a Ray actor; ``ReplicaCalls``: its calls to the replicas
(resynchronisation from their snapshots; after a restart, their nodes and step costs).

Replicas report to it fire-and-forget after each engine step; the HTTP front asks it for a
replica per request (``route_many``: the requests that arrived together, in one call). It is
not on the token path. On an event gap it asks the replica for a
snapshot; after a restart of the router itself, it rebuilds every replica's index the same way,
and asks the replicas again for what the deployment told it at start-up (their nodes, and the
ttft profile's measured costs). Ray re-creates a restarted router at its start-up size: a
deployment resized since tells it its replicas again (``sync_members``; the deployment notices
the new ``incarnation``).
"""

import asyncio
import logging
import uuid
import warnings
from collections.abc import Collection, Sequence

import ray

from replicas.kv.events import KVEventBatch, KVSnapshot
from replicas.kv.hashing import BlockHash
from replicas.step_costs import PullCosts, StepCosts, median_costs
from router.config import RoutingConfig, TTFTCosts
from router.policies import RouteDecision
from router.router import NoLiveReplicaError, Router
from router.stats import RouterStats

logger = logging.getLogger(__name__)

PRICING_TIMEOUT_S = 60.0
"""How long routing waits for the ttft profile's measured costs before it fails."""
PRICING_ATTEMPTS = 30
"""Rounds (1 s apart) in which a restarted router asks the replicas for their step costs."""
NODE_ATTEMPTS = 30
"""Rounds (1 s apart) in which a restarted router asks the replicas which node each runs on."""


def measured_ttft_costs(measured: Sequence[StepCosts]) -> TTFTCosts:
    """The ttft profile's costs from the replicas' start-up measurements: each one's median."""
    return TTFTCosts(**median_costs(measured).ttft_costs())


class ReplicaCalls:
    """The router actor's calls to its replicas' actors, found by the names the deployment gave
    them: a snapshot on an event gap (one in flight per replica; ``router`` resyncs from it), and,
    after a restart of the router, each replica's node and the step costs they measured. Without
    a ``name_prefix`` (a router no deployment named) it asks for no snapshot."""

    def __init__(self, router: Router, name_prefix: str | None) -> None:
        self.router = router
        self.name_prefix = name_prefix
        self._resyncing: set[int] = set()

    def schedule_resync(self, replica_index: int) -> None:
        """Ask the replica for a snapshot and resync the router from it, in a task of its own
        (no-op while one is in flight for the replica)."""
        if replica_index in self._resyncing or self.name_prefix is None:
            return
        self._resyncing.add(replica_index)
        asyncio.get_event_loop().create_task(self._resync(replica_index))

    async def _resync(self, replica_index: int) -> None:
        try:
            replica = self._replica(replica_index)
            snapshot = await replica.snapshot.remote()
            self.router.resync(snapshot)
        except Exception as error:  # the replica may be dead or restarting; routing goes on
            logger.warning("resync of replica %d failed: %s", replica_index, error)
        finally:
            self._resyncing.discard(replica_index)

    async def nodes(self, num_replicas: int) -> list[str]:
        """Each replica's node, asked of the replicas (one that does not answer within
        ``NODE_ATTEMPTS`` rounds counts as a node of its own, ``unknown-<index>``)."""
        nodes: dict[int, str] = {}
        for _ in range(NODE_ATTEMPTS):
            for index in range(num_replicas):
                if index in nodes:
                    continue
                try:
                    replica = self._replica(index)
                    nodes[index] = str((await replica.info.remote())["node_id"])
                except Exception as error:  # dead or restarting: asked again next round
                    logger.warning("replica %d did not say its node: %s", index, error)
            if len(nodes) == num_replicas:
                break
            await asyncio.sleep(1.0)
        else:
            logger.error(
                "replicas %s did not say their nodes: the router credits their disk blocks to "
                "them alone",
                sorted(set(range(num_replicas)) - set(nodes)),
            )
        return [nodes.get(i, f"unknown-{i}") for i in range(num_replicas)]

    async def ttft_costs(self, num_replicas: int) -> TTFTCosts | None:
        """The ttft profile's costs from the step costs the replicas measured when they started
        (None when none reports any within ``PRICING_ATTEMPTS`` rounds)."""
        for _ in range(PRICING_ATTEMPTS):
            measured = []
            for index in range(num_replicas):
                try:
                    replica = self._replica(index)
                    costs = await replica.step_costs.remote()
                except Exception as error:  # dead or restarting: the others may answer
                    logger.warning("replica %d has no step costs: %s", index, error)
                    continue
                if costs is not None:
                    measured.append(costs)
            if measured:
                return measured_ttft_costs(measured)
            await asyncio.sleep(1.0)
        logger.error("no replica reported step costs: the ttft profile cannot route")
        return None

    def _replica(self, index: int) -> ray.actor.ActorHandle:
        """Replica ``index``'s actor, by the name the deployment gave it (raises while it is
        gone)."""
        return ray.get_actor(f"{self.name_prefix}-replica-{index}")


class RouterActor:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        config: RoutingConfig,
        replica_name_prefix: str | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self.router = Router(num_replicas, block_size, config, sliding_window)
        self._replicas = ReplicaCalls(self.router, replica_name_prefix)
        self._node_ids: list[str] | None = None  # set_nodes' (None: each replica its own node)
        self.incarnation = uuid.uuid4().hex  # tells a restarted router from the one before
        # Routing waits for the ttft profile's costs when the deployment measures them.
        self._priced = asyncio.Event()
        if not config.needs_ttft_costs:
            self._priced.set()
        with warnings.catch_warnings():  # Ray's own property uses a deprecated accessor
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:
            # Ray restarted the router: its index is empty, so rebuild it from snapshots.
            for index in range(num_replicas):
                self.router.request_resync(index)
                self._replicas.schedule_resync(index)
            if replica_name_prefix is not None:
                loop = asyncio.get_event_loop()
                fetches = [self._fetch_nodes(num_replicas)]
                if config.needs_ttft_costs:
                    fetches.append(self._fetch_ttft_costs(num_replicas))
                self._fetching = [loop.create_task(fetch) for fetch in fetches]  # kept: not GC'd

    async def route(
        self,
        request_id: str,
        num_prompt_tokens: int,
        block_hashes: Sequence[BlockHash],
        exclude: Collection[int] = (),
        cache_key: str | None = None,
    ) -> RouteDecision:
        await self._wait_priced()
        return self.router.route(request_id, num_prompt_tokens, block_hashes, exclude, cache_key)

    async def route_many(
        self,
        requests: Sequence[tuple[str, int, Sequence[BlockHash], Collection[int], str | None]],
    ) -> list[RouteDecision | NoLiveReplicaError]:
        """``route`` for each of several requests, in order, in one call: each request's
        decision, or the ``NoLiveReplicaError`` it got (the others are routed regardless)."""
        await self._wait_priced()
        decisions: list[RouteDecision | NoLiveReplicaError] = []
        for request in requests:
            try:
                decisions.append(self.router.route(*request))
            except NoLiveReplicaError as error:
                decisions.append(error)
        return decisions

    async def report(
        self, batch: KVEventBatch, generated: dict[str, int], finished: Sequence[str]
    ) -> None:
        """One engine step of one replica: its KV events, generated tokens, ended requests."""
        if not self.router.on_events(batch) and batch.replica_index in self.router.needs_resync():
            self._replicas.schedule_resync(batch.replica_index)
        for request_id, num_tokens in generated.items():
            self.router.add_generated(request_id, num_tokens)
        for request_id in finished:
            self.router.release(request_id)

    async def release(self, request_id: str) -> None:
        self.router.release(request_id)

    async def release_many(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.router.release(request_id)

    async def mark_dead(self, replica_index: int) -> None:
        self.router.mark_dead(replica_index)

    async def mark_alive(self, replica_index: int) -> None:
        """A (restarted) replica is back: it rejoins with the index from its snapshot."""
        self.router.mark_alive(replica_index)
        self.router.request_resync(replica_index)
        self._replicas.schedule_resync(replica_index)

    async def ready(self) -> str:
        """This router's incarnation id: it changes when Ray restarts the router."""
        return self.incarnation

    # ---- resizing (cluster.scaling) ----------------------------------------------------------
    async def add_replica(self, node_id: str) -> int:
        """A replica joins on node ``node_id``: indexed from its first event, not routed to
        until ``start_routing``. Its index (the next unused one)."""
        replica = self.router.add_replica(node_id)
        if self._node_ids is not None:
            self._node_ids.append(node_id)
        return replica

    async def start_routing(self, replica_index: int) -> None:
        self.router.start_routing(replica_index)

    async def set_draining(self, replica_index: int) -> None:
        self.router.set_draining(replica_index)

    async def retire(self, replica_index: int, snapshot: KVSnapshot | None = None) -> None:
        self.router.retire(replica_index, snapshot)

    async def sync_members(self, roles: Sequence[str], node_ids: Sequence[str]) -> None:
        """The deployment's replicas, by index (``Router.sync_members``); each replica still
        in it is resynchronised from its snapshot."""
        self.router.sync_members(roles, node_ids)
        self._node_ids = list(node_ids)
        for index, role in enumerate(self.router.roles()):
            if role != "retired":
                self.router.request_resync(index)
                self._replicas.schedule_resync(index)

    async def set_nodes(self, node_ids: Sequence[str]) -> None:
        """Which node each replica runs on (replicas of one node share its disk tier)."""
        self.router.set_nodes(node_ids)
        self._node_ids = list(node_ids)

    async def nodes(self) -> list[str] | None:
        """The node of each replica, as last set (None: not set; each counts as its own)."""
        return self._node_ids

    async def _fetch_nodes(self, num_replicas: int) -> None:
        """After a restart of the router: each replica's node, asked of the replicas."""
        nodes = await self._replicas.nodes(num_replicas)
        if self._node_ids is None:  # unless the deployment set them meanwhile
            await self.set_nodes(nodes)

    async def set_ttft_costs(self, costs: TTFTCosts) -> None:
        """The ttft profile's costs, measured on the replicas at start-up."""
        self.router.set_ttft_costs(costs)
        self._priced.set()

    async def set_pull_costs(self, replica_index: int, costs: PullCosts) -> None:
        """What pulling a prefix from a peer costs a replica (it reports them itself)."""
        self.router.set_pull_costs(replica_index, costs)

    async def ttft_costs(self) -> TTFTCosts | None:
        """The ttft profile's cost profile in effect (None: another profile, or not yet set)."""
        return self.router.config.ttft_costs

    async def _wait_priced(self) -> None:
        if self._priced.is_set():
            return
        try:
            await asyncio.wait_for(self._priced.wait(), PRICING_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(
                f"the ttft profile got no cost profile within {PRICING_TIMEOUT_S:g} s"
            ) from None

    async def _fetch_ttft_costs(self, num_replicas: int) -> None:
        """After a restart of the router: the costs the replicas measured when they started."""
        costs = await self._replicas.ttft_costs(num_replicas)
        if costs is not None:
            await self.set_ttft_costs(costs)

    async def live_replicas(self) -> list[int]:
        return self.router.live_replicas()

    async def stats(self) -> RouterStats:
        return self.router.stats()
