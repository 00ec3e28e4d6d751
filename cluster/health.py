"""Liveness of a Ray deployment's replicas, as its backend and its router see it.

``HealthMonitor`` pings every replica each ``HEALTH_INTERVAL_S`` on the serving event loop::

    answers with the incarnation it had          -> live, nothing changes
    no answer in HEALTH_TIMEOUT_S, or an error   -> lost: out of routing
    answers with a new incarnation id            -> Ray restarted it: back in routing, with an
                                                    empty cache

The router hears of every change. A loss is told again each time it is seen (idempotent): a
router that Ray restarted believes every replica live. The router is pinged too: a new
incarnation (Ray re-created it at its start-up size) calls ``on_router_restart``, so that a
resized deployment tells it its replicas again.

A resize adds a replica once it is ready (``add``) and retires one after it drained
(``retire``): a retired replica is never pinged again and counts for nothing; lists stay
indexed by replica index.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ray.actor import ActorHandle
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

logger = logging.getLogger(__name__)

ACTOR_LOST = (RayActorError, ActorUnavailableError)
"""What a call to a replica raises when its process is gone or restarting."""
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 10.0


class HealthMonitor:
    """Owns which replicas are live and which incarnation of each was last seen."""

    def __init__(
        self,
        replicas: list[ActorHandle],
        router: ActorHandle,
        incarnations: list[str],
        on_router_restart: Callable[[], Awaitable[None]] | None = None,
        router_incarnation: str | None = None,
    ) -> None:
        self.replicas = list(replicas)
        self.router = router
        self.incarnations = list(incarnations)
        self._alive = [True] * len(replicas)
        self._retired: set[int] = set()
        self._task: asyncio.Task | None = None
        self._on_router_restart = on_router_restart
        self._router_incarnation = router_incarnation

    def is_alive(self, index: int) -> bool:
        return self._alive[index] and index not in self._retired

    @property
    def num_live(self) -> int:
        return sum(self.is_alive(i) for i in range(len(self._alive)))

    def add(self, index: int, replica: ActorHandle, incarnation: str) -> None:
        """Watch replica ``index``, live from now on (indices below it that were never added
        count as retired: they never joined)."""
        while len(self.replicas) <= index:
            self._retired.add(len(self.replicas))
            self.replicas.append(None)
            self.incarnations.append("")
            self._alive.append(False)
        self.replicas[index] = replica
        self.incarnations[index] = incarnation
        self._alive[index] = True
        self._retired.discard(index)

    def retire(self, index: int) -> None:
        """Stop watching replica ``index`` for good (a scale-in removed it)."""
        self._retired.add(index)

    def ensure_running(self) -> None:
        """Ping on the running event loop (once per loop: a new loop gets a new pinging task)."""
        loop = asyncio.get_running_loop()
        task = self._task
        if task is None or task.done() or task.get_loop() is not loop:
            self._task = loop.create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def mark_lost(self, index: int) -> None:
        """Take replica ``index`` out of routing until it answers again."""
        if index in self._retired:
            return
        if self._alive[index]:
            logger.warning("replica %d is unreachable; removing it from routing", index)
            self._alive[index] = False
        self.router.mark_dead.remote(index)

    async def _watch(self) -> None:
        while True:
            members = [i for i in range(len(self.replicas)) if i not in self._retired]
            await asyncio.gather(*(self._check(i) for i in members), self._check_router())
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _check_router(self) -> None:
        try:
            incarnation = await asyncio.wait_for(self.router.ready.remote(), HEALTH_TIMEOUT_S)
        except (*ACTOR_LOST, RayTaskError, TimeoutError):  # restarting: asked again next round
            return
        previous, self._router_incarnation = self._router_incarnation, incarnation
        if previous is not None and incarnation != previous:
            logger.warning("the router restarted; telling it the deployment's replicas")
            if self._on_router_restart is not None:
                try:
                    await self._on_router_restart()
                except (*ACTOR_LOST, RayTaskError) as error:
                    logger.warning("could not tell the restarted router its replicas: %s", error)
                    self._router_incarnation = previous  # told again next round

    async def _check(self, index: int) -> None:
        try:
            incarnation = await asyncio.wait_for(
                self.replicas[index].ready.remote(), HEALTH_TIMEOUT_S
            )
        except (*ACTOR_LOST, RayTaskError, TimeoutError):  # a failed engine raises
            self.mark_lost(index)
            return
        if index in self._retired:  # retired while the ping was out
            return
        if not self._alive[index] or incarnation != self.incarnations[index]:
            logger.warning(
                "replica %d is back (incarnation %s); it rejoins routing", index, incarnation
            )
            self.incarnations[index] = incarnation
            self._alive[index] = True
            await self.router.mark_alive.remote(index)
