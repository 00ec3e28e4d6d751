"""Liveness of a Ray deployment's replicas, as its backend and its router see it.

``HealthMonitor`` pings every replica each ``HEALTH_INTERVAL_S`` on the serving event loop::

    answers with the incarnation it had          -> live, nothing changes
    no answer in HEALTH_TIMEOUT_S, or an error   -> lost: out of routing
    answers with a new incarnation id            -> Ray restarted it: back in routing, with an
                                                    empty cache

The router hears of every change. A loss is told again each time it is seen (idempotent): a
router that Ray restarted believes every replica live.
"""

import asyncio
import logging

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
        self, replicas: list[ActorHandle], router: ActorHandle, incarnations: list[str]
    ) -> None:
        self.replicas = replicas
        self.router = router
        self.incarnations = list(incarnations)
        self._alive = [True] * len(replicas)
        self._task: asyncio.Task | None = None

    def is_alive(self, index: int) -> bool:
        return self._alive[index]

    @property
    def num_live(self) -> int:
        return sum(self._alive)

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
        if self._alive[index]:
            logger.warning("replica %d is unreachable; removing it from routing", index)
            self._alive[index] = False
        self.router.mark_dead.remote(index)

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(i) for i in range(len(self.replicas))))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _check(self, index: int) -> None:
        try:
            incarnation = await asyncio.wait_for(
                self.replicas[index].ready.remote(), HEALTH_TIMEOUT_S
            )
        except (*ACTOR_LOST, RayTaskError, TimeoutError):  # a failed engine raises
            self.mark_lost(index)
            return
        if not self._alive[index] or incarnation != self.incarnations[index]:
            logger.warning(
                "replica %d is back (incarnation %s); it rejoins routing", index, incarnation
            )
            self.incarnations[index] = incarnation
            self._alive[index] = True
            await self.router.mark_alive.remote(index)
