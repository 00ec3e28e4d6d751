"""Where an engine's time goes, and what it learns from it: the steps' and the gaps' seconds
(``StepTimes``, in the engine's stats), and, with a host tier, the measured cost of a block to
recompute and to copy, which the adaptive retention policy reads (``replicas.kv.retention``),
with its tuning hint logged every ``tuning_hint_interval_s``."""

import logging
import time
from dataclasses import dataclass

from replicas.kv.manager import KVCacheManager
from replicas.kv.retention import BlockCosts, tuning_hint
from replicas.kv.transfer import KVTransfer

logger = logging.getLogger(__name__)

COST_UPDATE_STEPS = 16
"""Steps between updates of the measured block costs the adaptive policy reads."""


@dataclass(slots=True)
class StepTimes:
    """Where a busy engine's time goes: ``step_seconds`` inside its steps, ``gap_seconds``
    between a step and the next one while requests were unfinished (the serving layer's share:
    dispatching outputs, taking requests in, waiting for the event loop)."""

    num_steps: int = 0
    step_seconds: float = 0.0
    gap_seconds: float = 0.0


class StepMeter:
    """Times an engine's steps and, with a host tier (``transfer``), feeds the cache manager
    the block costs measured from them."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        transfer: KVTransfer | None,
        block_size: int,
        tuning_hint_interval_s: float | None,
    ) -> None:
        self.times = StepTimes()
        self._kv_cache = kv_cache
        self._transfer = transfer
        self._block_size = block_size
        self.tuning_hint_interval_s = tuning_hint_interval_s if transfer is not None else None
        self._busy_since: float | None = None  # end of the last step, while work remained
        self._compute = _ComputeTime()  # per token, from steps with a prefill's worth of tokens
        self._last_hint = time.monotonic()

    def start(self) -> float:
        """A step starts: the gap since the last one counts if work remained; returns its start."""
        start = time.perf_counter()
        if self._busy_since is not None:
            self.times.gap_seconds += start - self._busy_since
        return start

    def stop(self, start: float, num_tokens: int, busy: bool) -> None:
        """The step begun at ``start`` computed ``num_tokens``; ``busy``: work remains."""
        end = time.perf_counter()
        self.times.num_steps += 1
        self.times.step_seconds += end - start
        self._busy_since = end if busy else None
        if self._transfer is not None:
            self._after_step(end - start, num_tokens)

    def idle(self) -> None:
        """No work is left (an abort or a shed emptied the engine): not a gap between steps."""
        self._busy_since = None

    def reset(self) -> None:
        self.times = StepTimes()
        self._busy_since = None

    def _after_step(self, seconds: float, num_tokens: int) -> None:
        """Measure what a block costs to compute and to copy, for the adaptive policy; log the
        tuning hint every ``tuning_hint_interval_s``."""
        if num_tokens >= self._block_size:
            self._compute.add(seconds, num_tokens)
        if self.times.num_steps % COST_UPDATE_STEPS == 0:
            costs = self.block_costs()
            if costs is not None:
                self._kv_cache.set_block_costs(costs)
        interval = self.tuning_hint_interval_s
        now = time.monotonic()
        if interval is not None and now - self._last_hint >= interval:
            self._last_hint = now
            for line in self.tuning_hints():
                logger.info("%s", line)

    def block_costs(self) -> BlockCosts | None:
        """Measured seconds per block: recompute (from steps that computed at least a block),
        reload and store (the transfers' time per block moved; both share it); None until both
        have been measured."""
        per_token = self._compute.per_token()
        stats = self._transfer.stats if self._transfer else None
        moved = stats.blocks_loaded + stats.blocks_stored if stats else 0
        if per_token is None or not moved:
            return None
        per_copy = stats.seconds / moved
        return BlockCosts(per_token * self._block_size, per_copy, per_copy)

    def tuning_hints(self) -> list[str]:
        """One line per cache type with a host tier (see ``kv_retention.tuning_hint``)."""
        cache = self._kv_cache
        policy = cache.views.retention_policy()
        lines = []
        for cache_type, stats in cache.views.retention_stats().items():
            line = tuning_hint(cache_type, stats, cache.stats.queries, policy)
            if line is not None:
                lines.append(line)
        return lines


class _ComputeTime:
    """Seconds per computed token, an exponential average over steps."""

    __slots__ = ("_per_token",)

    def __init__(self) -> None:
        self._per_token: float | None = None

    def add(self, seconds: float, num_tokens: int) -> None:
        sample = seconds / num_tokens
        previous = self._per_token
        self._per_token = sample if previous is None else 0.9 * previous + 0.1 * sample

    def per_token(self) -> float | None:
        return self._per_token
