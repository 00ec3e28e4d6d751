"""One simulated replica: the real ``replicas.engine.core.EngineCore`` with a cost model for
an executor and transfers that land at once.

A step is split where simulated time passes::

    begin_step(now)   EngineCore.begin_step: schedule -> transfer (the plan's copies land at
                      once) -> execute (the cost model prices the batch: StepTiming); returns
                      when the step ends. Meanwhile only ``add_request`` touches the replica
                      (the scheduler reads its queue at the next step)
    interrupt(now)    a request arrived: cut the step's decode tail at the next sub-step
                      boundary (a real engine admits it at its next step); the cut-off time
                      is owed and added to the next step's tail
    end_step(now)     EngineCore.end_step, the real engine's update: a request whose context is
                      complete gets one output token (a fixed dummy id: outputs never match a
                      later prompt), its first token stamped when the step's prefill part
                      ended; the stores planned while caching land at once, their time charged
                      to the next step; KV events are drained into one KVEventBatch with this
                      replica's sequence numbers

A replica added to a running cluster first warms its host tier from the node's disk
(``warm_from_disk``: the real ``KVCacheManager.start_warm`` rounds, each round's reads landing
``CostModel.disk_load_s`` after it starts) and ``publish``es the host blocks it loaded.
"""

import math
from dataclasses import dataclass, field

from benchmarks.sim.cost_model import CostModel, StepTiming
from benchmarks.sim.peer_tier import PEER
from replicas.config import SchedulerConfig
from replicas.engine.core import EngineCore, StepInFlight, StepResult
from replicas.engine.request import Request
from replicas.engine.scheduler import SchedulerOutput
from replicas.kv.events import KVEventBatch, Tier
from replicas.kv.handover import HANDOVER_BATCH_BLOCKS
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import BackingCopy, TransferPlan

OUTPUT_TOKEN_ID = 0
"""The token every simulated output is (the real engine's outputs are the model's argmax)."""


@dataclass(slots=True)
class StepReport:
    """What a replica tells its router after one step (as ``replicas.actor`` does)."""

    events: KVEventBatch
    generated: list[str] = field(default_factory=list)
    first_token: list[str] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


class CostModelExecutor:
    """Executes a step on paper: ``last_timing`` is what the cost model says it takes; every
    request whose context the step completes gets ``OUTPUT_TOKEN_ID``."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.last_timing: StepTiming | None = None

    def execute(self, output: SchedulerOutput) -> StepResult:
        self.last_timing = self.cost_model.step_timing(output.scheduled, output.transfer)
        requests = [s.request for s in output.scheduled if s.is_sampled]
        return StepResult(requests, [OUTPUT_TOKEN_ID] * len(requests))

    def release(self, request_id: str) -> None:
        return


class InstantTransfer:
    """Copies land as soon as they are submitted; remembers the last plan for its price. With a
    disk tier (``disk``: a ``benchmarks.sim.disk.DiskView`` per cache type), its stores land at
    once too, and a plan's reads land ``CostModel.disk_load_s`` after ``now`` (the simulated
    engine sets it before each step). With a peer tier (``peer``: a
    ``benchmarks.sim.peer_tier.SimPeerStore`` per cache type), a plan's pulls land when the
    store says, each valid or a miss."""

    def __init__(
        self,
        cost_model: CostModel | None = None,
        disk: dict | None = None,
        peer: dict | None = None,
    ) -> None:
        self.last_plan = TransferPlan([], [])
        self._landed: list[TransferPlan] = []
        self.cost_model = cost_model
        self.disk = disk or {}
        self.peer = peer or {}
        self.now = 0.0
        self._reads: list[tuple[float, list[tuple[BackingCopy, bool]]]] = []  # (lands at, copies)

    def submit(self, plan: TransferPlan) -> None:
        self.last_plan = plan
        self._landed.append(plan)
        for copy in plan.backing_stores:
            self.disk[copy.cache_type].store(copy.block_hash, copy.weight)
        if not plan.backing_loads:
            return
        pulls: dict[str, list[BackingCopy]] = {}
        reads = []
        for copy in plan.backing_loads:
            if copy.tier == PEER:
                pulls.setdefault(copy.cache_type, []).append(copy)
            else:
                self.disk[copy.cache_type].touch(copy.block_hash)
                reads.append((copy, True))
        if reads:
            self._reads.append((self.now + self.cost_model.disk_load_s(len(reads)), reads))
        for cache_type, copies in pulls.items():
            self._reads.extend(self.peer[cache_type].read(copies, self.now))

    def poll(self, wait: bool = False) -> list[TransferPlan]:
        landed, self._landed = self._landed, []
        return landed

    def poll_backing(self, timeout: float | None = 0.0) -> list[tuple[BackingCopy, bool]]:
        """The reads landed by ``now`` (a simulated wait is a later step, never a block)."""
        done = [copies for lands, copies in self._reads if lands <= self.now]
        self._reads = [(lands, copies) for lands, copies in self._reads if lands > self.now]
        return [result for copies in done for result in copies]

    def next_landing(self) -> float | None:
        """When the next disk read lands, None with none in flight."""
        return min((lands for lands, _ in self._reads), default=None)


@dataclass(slots=True)
class _Step:
    step: StepInFlight
    timing: StepTiming
    start_s: float
    end_s: float


class SimulatedEngine:
    """One replica of the simulated cluster (see the module docstring)."""

    def __init__(
        self,
        replica_index: int,
        kv_cache: KVCacheManager,
        scheduler_config: SchedulerConfig,
        cost_model: CostModel,
        max_model_len: int,
        disk: dict | None = None,
        peer: dict | None = None,
    ) -> None:
        self.replica_index = replica_index
        self.kv_cache = kv_cache
        self.cost_model = cost_model
        self._executor = CostModelExecutor(cost_model)
        self._transfer = InstantTransfer(cost_model, disk, peer)
        self.core = EngineCore(
            scheduler_config,
            kv_cache,
            self._executor,
            max_model_len=max_model_len,
            transfer=self._transfer,
        )
        self.num_steps = 0
        self.busy_s = 0.0
        self._next_seq = 0
        self._carry_s = 0.0  # copies planned at the last step's end, paid by the next step
        self._owed_s = 0.0  # decode tail cut off by an arrival, paid by the next step's tail
        self._step: _Step | None = None

    @property
    def is_busy(self) -> bool:
        return self._step is not None

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    @property
    def num_unfinished(self) -> int:
        return self.core.num_unfinished

    @property
    def num_preemptions(self) -> int:
        return self.core.num_preemptions

    def add_request(self, request: Request) -> None:
        self.core.add(request)

    def offer_peer_blocks(self, request: Request, source: int, num_tokens: int) -> None:
        """The router named ``source`` as holding ``num_tokens`` leading prompt tokens: their
        blocks are the peer tier's to read for this request, as ``Engine._offer_peer_blocks``
        (ignored without that tier). Call before ``add_request``."""
        num_blocks = min(num_tokens // self.kv_cache.block_size, len(request.block_hashes))
        for store in self._transfer.peer.values():
            store.offer(request.block_hashes[:num_blocks], source)

    def peer_stats(self) -> dict[str, float]:
        """The peer tier's pull counters, summed over cache types (empty without the tier)."""
        totals: dict[str, float] = {}
        for store in self._transfer.peer.values():
            for name, value in store.stats().items():
                totals[name] = totals.get(name, 0) + value
        return totals

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def begin_step(self, now: float) -> float | None:
        """Schedule one step; return when it ends, or None if nothing can run."""
        if self._step is not None:
            raise RuntimeError(f"replica {self.replica_index} is already running a step")
        self._transfer.now = now
        try:
            step = self.core.begin_step()
        except RuntimeError as error:
            raise RuntimeError(f"replica {self.replica_index}: {error}") from None
        if step is None:
            return None
        timing = self._executor.last_timing
        timing = timing._replace(
            first_s=timing.first_s + self._carry_s, tail_s=timing.tail_s + self._owed_s
        )
        self._carry_s = self._owed_s = 0.0
        self._step = _Step(step, timing, now, now + timing.total_s)
        self.num_steps += 1
        self.busy_s += timing.total_s
        return self._step.end_s

    def next_disk_landing(self) -> float | None:
        """When an idle replica waiting for disk reads should try a step again."""
        return self._transfer.next_landing()

    def interrupt(self, now: float) -> float | None:
        """Cut the running step's decode tail at the first sub-step boundary after ``now``;
        return the new end time, or None if the step cannot end sooner."""
        step = self._step
        if step is None or step.timing.sub_step_s <= 0:
            return None
        tail_start = step.start_s + step.timing.first_s
        if now <= tail_start:
            return None  # still in the step's first real step: the arrival waits for it
        num_sub_steps = math.ceil((now - tail_start) / step.timing.sub_step_s)
        end = tail_start + num_sub_steps * step.timing.sub_step_s
        if end >= step.end_s:
            return None
        self._owed_s += step.end_s - end
        self.busy_s -= step.end_s - end
        step.end_s = end
        return end

    def end_step(self, now: float) -> StepReport:
        """Apply the step's results at simulated time ``now`` (see the module docstring)."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError(f"replica {self.replica_index} has no step in flight")
        first_token_s = min(now, step.start_s + step.timing.first_s)
        report = StepReport(KVEventBatch(self.replica_index, self._next_seq, ()))
        for request in self.core.end_step(step.step, now=now, first_token_time=first_token_s):
            report.generated.append(request.request_id)
            if request.num_output_tokens == 1:
                report.first_token.append(request.request_id)
            if request.is_finished:
                report.finished.append(request)
        self._carry_s = self.cost_model.transfer_s(self._transfer.last_plan)
        report.events = self._drain_events()  # this step's events: schedule, cache, stores
        return report

    def warm_from_disk(self, now: float, time_budget_s: float) -> tuple[int, float]:
        """``Engine.warm_from_disk`` on simulated time, from ``now``: the node's disk blocks,
        hottest first, into empty host blocks, a round of reads at a time, until the host tier
        or the disk has no more or ``time_budget_s`` has passed. Returns the blocks loaded and
        when the last round landed. Call before the replica serves (no step runs meanwhile)."""
        if not self._transfer.disk:
            return 0, now
        warm = self.kv_cache.start_warm()
        num_before = self.kv_cache.stats.tier(Tier.DISK).blocks_loaded
        deadline = now + time_budget_s
        while not warm.is_done and now < deadline:
            self._transfer.now = now
            if not warm.plan_round(HANDOVER_BATCH_BLOCKS):
                break
            self.core.flush_transfers()
            now = self._transfer.next_landing() or now
            self._transfer.now = now
            self.core.complete_backing_loads(0.0)
        return self.kv_cache.stats.tier(Tier.DISK).blocks_loaded - num_before, now

    def publish(self) -> StepReport:
        """The KV events recorded since the last step, in a report with no tokens."""
        return StepReport(self._drain_events())

    def _drain_events(self) -> KVEventBatch:
        events = tuple(self.kv_cache.views.drain_events())
        batch = KVEventBatch(self.replica_index, self._next_seq, events)
        self._next_seq = batch.next_seq
        return batch
