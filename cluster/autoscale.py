"""The autoscaling policy: how many replicas a deployment wants, from how long requests queue.

Each tick (every ``metrics_interval_s``) the ``Autoscaler`` reads ``Backend.stats()``, turns it
into one ``ReplicaLoad`` per live replica (``QueueEstimator``) and asks the ``AutoscalePolicy``
for a ``ScaleDecision``; a change goes to ``Backend.scale(n)``, which adds replicas warm and
removes the one whose cache is worth least (``cluster.scaling``). The policy is a plain class on
a clock it is handed, so tests drive it with fake stats and a fake clock.

The signal is the **predicted queueing** of a replica: the prompt tokens routed to it and not
yet past prefill, over the prompt tokens it computes per second of its steps::

    queue_s[r] = router.replicas[r].queued_tokens / throughput[r]
    throughput[r] = delta(cache.queries - cache.hits) / delta(steps.step_seconds)   (EngineStats)

averaged over the live replicas (``queue_s`` of the cluster), then over the samples of the last
``look_back_period_s``. The fields read are ``ClusterStats.replicas[r].engine``
(``num_waiting``, ``num_running``, ``cache.queries``, ``cache.hits``, ``steps.step_seconds``)
and ``ClusterStats.router.replicas[r]`` (``queued_tokens``, and ``role``: only serving
replicas count, not those joining or draining). A replica whose throughput is not
measured yet takes the mean of those measured (none measured: its queue counts as empty).

Decisions, with ``n`` replicas and ``q`` the averaged queueing (names are Ray Serve's
``autoscaling_config``, whose conventions this follows; ``target_queue_s`` replaces its
``target_ongoing_requests``)::

    out   q > target_queue_s, continuously for upscale_delay_s:
          n + max(1, ceil((ceil(n * q / target) - n) * upscaling_factor)), at most max_replicas
    in    the fewest m < n replicas that fit (q * n / m < downscale_queue_fraction * target and
          running + waiting requests <= m * max_num_seqs) exist, continuously for
          downscale_delay_s: n - max(1, floor((n - m) * downscaling_factor)), at least min_replicas
    hold  otherwise; and always while a change is in flight or for cooldown_s after one, whose
          end also restarts the look-back and both delays (hysteresis: the band between
          downscale_queue_fraction * target and target changes nothing)

A size outside ``[min_replicas, max_replicas]`` (a replica lost for good) is brought back at once.

A scale-out the Ray cluster cannot place now waits, where the cluster can grow, up to
``ray.scale_out_wait_s`` for Ray to place it (``cluster.resize``): the tick waits with it (the
policy would hold meanwhile anyway), and a refusal is one warning, then the cool-down and the
upscale delay before the policy asks again, so a cluster that does not grow costs one try,
and one warning, per ``scale_out_wait_s + cooldown_s + upscale_delay_s``.
"""

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from cluster.backend import ClusterStats
from cluster.config import ScalingConfig
from replicas.engine.engine import EngineStats

if TYPE_CHECKING:
    from cluster.deploy import RayBackend

logger = logging.getLogger(__name__)

UP, DOWN, HOLD = "up", "down", "hold"
DIRECTIONS = (UP, DOWN, HOLD)


class ReplicaLoad(NamedTuple):
    """One live replica at one tick, as the policy sees it."""

    replica_index: int
    num_waiting: int
    num_running: int
    queue_s: float  # predicted seconds a new request waits before its prefill starts


class ScaleDecision(NamedTuple):
    num_replicas: int  # the size wanted
    direction: str  # UP, DOWN or HOLD
    reason: str


class _Sample(NamedTuple):
    time_s: float
    queue_s: float


class AutoscalePolicy:
    """The decision rule of the module docstring; no I/O. ``decide`` mutates the look-back
    window and the delay timers; ``begin_change``/``end_change`` bracket a resize."""

    def __init__(self, config: ScalingConfig, max_num_seqs: int) -> None:
        self.config = config
        self.max_num_seqs = max_num_seqs
        self._samples: deque[_Sample] = deque()
        self._above_since: float | None = None  # q above target since
        self._idle_since: float | None = None  # one fewer replica fitting since
        self._is_changing = False
        self._quiet_until = -math.inf  # end of the cool-down

    def decide(self, num_replicas: int, loads: Sequence[ReplicaLoad], now: float) -> ScaleDecision:
        """The size wanted at ``now`` by a deployment of ``num_replicas`` whose live replicas
        report ``loads``."""
        c, n = self.config, num_replicas
        if n < c.min_replicas or n > c.max_replicas:
            size = min(max(n, c.min_replicas), c.max_replicas)
            return ScaleDecision(size, UP if size > n else DOWN, f"{n} replicas outside bounds")
        if self._is_changing:
            return ScaleDecision(n, HOLD, "a resize is in flight")
        if now < self._quiet_until:
            return ScaleDecision(n, HOLD, "cooling down after a resize")
        queue_s = sum(load.queue_s for load in loads) / len(loads) if loads else 0.0
        self._samples.append(_Sample(now, queue_s))
        while self._samples[0].time_s <= now - c.look_back_period_s:
            self._samples.popleft()
        q = sum(s.queue_s for s in self._samples) / len(self._samples)
        fit = self._fewest_fitting(n, q, sum(x.num_waiting + x.num_running for x in loads))
        self._above_since = _since(self._above_since, now) if q > c.target_queue_s else None
        self._idle_since = _since(self._idle_since, now) if fit is not None else None
        if self._above_since is not None:
            if n >= c.max_replicas:
                return ScaleDecision(n, HOLD, f"queueing {q:.2f}s over target at max_replicas")
            if now - self._above_since >= c.upscale_delay_s:
                wanted = math.ceil(n * q / c.target_queue_s)
                step = max(1, math.ceil((wanted - n) * (c.upscaling_factor or 1.0)))
                size = min(n + step, c.max_replicas)
                reason = (
                    f"predicted queueing {q:.2f}s > target {c.target_queue_s:g}s "
                    f"for {now - self._above_since:.0f}s"
                )
                return ScaleDecision(size, UP, reason)
        if fit is not None and now - self._idle_since >= c.downscale_delay_s:
            step = max(1, math.floor((n - fit) * (c.downscaling_factor or 1.0)))
            size = max(n - step, c.min_replicas)
            reason = (
                f"predicted queueing {q:.2f}s would stay under "
                f"{c.downscale_queue_fraction * c.target_queue_s:g}s on {fit} replica(s) "
                f"for {now - self._idle_since:.0f}s"
            )
            return ScaleDecision(size, DOWN, reason)
        return ScaleDecision(n, HOLD, f"predicted queueing {q:.2f}s")

    def _fewest_fitting(self, n: int, queue_s: float, num_requests: int) -> int | None:
        """The fewest replicas below ``n`` (and at least min_replicas) that would hold the
        requests with queueing under the scale-in band; None if not even ``n - 1`` would."""
        c = self.config
        bound = c.downscale_queue_fraction * c.target_queue_s
        fewest = None
        for m in range(n - 1, c.min_replicas - 1, -1):
            too_slow = queue_s > 0 and queue_s * n / m >= bound
            if too_slow or num_requests > m * self.max_num_seqs:
                break
            fewest = m
        return fewest

    def begin_change(self) -> None:
        self._is_changing = True

    def end_change(self, now: float) -> None:
        """A resize completed (or failed) at ``now``: cool down, and start the window anew."""
        self._is_changing = False
        self._quiet_until = now + self.config.cooldown_s
        self._samples.clear()
        self._above_since = self._idle_since = None


def _since(start: float | None, now: float) -> float:
    """When a condition that holds at ``now`` began: ``start``, or now if it just began."""
    return now if start is None else start


class QueueEstimator:
    """Per live replica, its ``ReplicaLoad`` from a ``ClusterStats`` (module docstring); keeps
    each replica's last counters to measure its throughput between two reads."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, float]] = {}  # computed tokens, step seconds
        self._throughput: dict[int, float] = {}  # prompt tokens computed per step second

    def loads(self, stats: ClusterStats) -> list[ReplicaLoad]:
        routing = {r.replica_index: r for r in stats.router.replicas} if stats.router else {}
        live = [
            r
            for r in stats.replicas
            if r.is_alive
            and r.engine is not None
            and (r.replica_index not in routing or routing[r.replica_index].role == "serving")
        ]
        for replica in live:
            self._measure(replica.replica_index, replica.engine)
        measured = list(self._throughput.values())
        fallback = sum(measured) / len(measured) if measured else 0.0
        loads = []
        for replica in live:
            index, engine = replica.replica_index, replica.engine
            throughput = self._throughput.get(index, fallback)
            queued = routing[index].queued_tokens if index in routing else 0
            queue_s = queued / throughput if throughput > 0 else 0.0
            loads.append(ReplicaLoad(index, engine.num_waiting, engine.num_running, queue_s))
        return loads

    def _measure(self, index: int, engine: EngineStats) -> None:
        computed = engine.cache.queries - engine.cache.hits
        step_s = engine.steps.step_seconds
        last_computed, last_step_s = self._last.get(index, (0, 0.0))
        if step_s < last_step_s:  # counters reset (a restarted replica)
            last_computed, last_step_s = 0, 0.0
        if step_s > last_step_s and computed > last_computed:
            self._throughput[index] = (computed - last_computed) / (step_s - last_step_s)
        self._last[index] = (computed, step_s)


class Autoscaler:
    """Polls a backend every ``metrics_interval_s`` and resizes it as the policy decides;
    ``on_decision`` (the metrics) hears every decision."""

    def __init__(
        self,
        config: ScalingConfig,
        max_num_seqs: int,
        on_decision: Callable[[ScaleDecision], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.policy = AutoscalePolicy(config, max_num_seqs)
        self.estimator = QueueEstimator()
        self.on_decision = on_decision
        self.clock = clock
        self.last_decision: ScaleDecision | None = None

    async def run(self, backend: "RayBackend") -> None:
        """Tick until cancelled; a failed read or resize is logged and the loop goes on."""
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            try:
                await self.tick(backend)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("autoscale: tick failed", exc_info=True)

    async def tick(self, backend: "RayBackend") -> ScaleDecision:
        """Read the stats once, decide, and resize if the decision says so."""
        stats = await backend.stats()
        num_replicas = backend.num_replicas()
        decision = self.policy.decide(num_replicas, self.estimator.loads(stats), self.clock())
        self.last_decision = decision
        if self.on_decision is not None:
            self.on_decision(decision)
        if decision.num_replicas == num_replicas:
            logger.debug("autoscale: %d replicas: %s", num_replicas, decision.reason)
            return decision
        logger.info(
            "autoscale: %d -> %d replicas: %s", num_replicas, decision.num_replicas, decision.reason
        )
        self.policy.begin_change()
        try:
            await backend.scale(decision.num_replicas)
        except ValueError as error:
            logger.warning("autoscale: resize to %d refused: %s", decision.num_replicas, error)
        finally:
            self.policy.end_change(self.clock())
        return decision
