"""One simulated replica: ``replicas.engine.Engine.step`` with a cost model for the forward pass.

A step is split where simulated time passes::

    begin_step(now)   schedule -> transfer (the plan's copies land at once) -> StepTiming;
                      returns when the step ends. Meanwhile only ``add_request`` touches the
                      replica (the scheduler reads its queue at the next step)
    interrupt(now)    a request arrived: cut the step's decode tail at the next sub-step
                      boundary (a real engine admits it at its next step); the cut-off time
                      is owed and added to the next step's tail
    end_step(now)     update exactly as Engine._update: num_computed_tokens += n; cache_blocks;
                      a request whose context is complete gets one output token (a fixed dummy
                      id: outputs never match a later prompt), its first token stamped when
                      the step's prefill part ended; finish at max_tokens; the stores planned
                      while caching (write-through threshold 0) are taken, their time charged
                      to the next step; KV events are drained into one KVEventBatch with this
                      replica's sequence numbers

Scheduler, KV cache manager and Request are the real classes from ``replicas``.
"""

import math
from dataclasses import dataclass, field

from benchmarks.sim.cost_model import CostModel, StepTiming
from replicas.config import SchedulerConfig
from replicas.kv_cache_manager import KVCacheManager
from replicas.kv_events import KVEventBatch
from replicas.request import Request, RequestStatus
from replicas.scheduler import Scheduler, SchedulerOutput

OUTPUT_TOKEN_ID = 0
"""The token every simulated output is (the real engine's outputs are the model's argmax)."""


@dataclass(slots=True)
class StepReport:
    """What a replica tells its router after one step (as ``replicas.actor`` does)."""

    events: KVEventBatch
    generated: list[str] = field(default_factory=list)
    first_token: list[str] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


@dataclass(slots=True)
class _Step:
    output: SchedulerOutput
    timing: StepTiming
    start_s: float
    end_s: float


class SimulatedEngine:
    def __init__(
        self,
        replica_index: int,
        kv_cache: KVCacheManager,
        scheduler_config: SchedulerConfig,
        cost_model: CostModel,
    ) -> None:
        self.replica_index = replica_index
        self.kv_cache = kv_cache
        self.kv_cache.record_events = True
        self.scheduler = Scheduler(scheduler_config, kv_cache)
        self.cost_model = cost_model
        self.num_steps = 0
        self.busy_s = 0.0
        self._next_seq = 0
        self._carry_s = 0.0  # copies planned at the last step's end, paid by the next step
        self._owed_s = 0.0  # decode tail cut off by an arrival, paid by the next step's tail
        self._step: _Step | None = None

    @property
    def is_busy(self) -> bool:
        return self._step is not None

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def begin_step(self, now: float) -> float | None:
        """Schedule one step; return when it ends, or None if nothing can run."""
        if self._step is not None:
            raise RuntimeError(f"replica {self.replica_index} is already running a step")
        output = self.scheduler.schedule()
        timing = self.cost_model.step_timing(output.scheduled, output.transfer)
        self.kv_cache.complete_transfer(output.transfer)
        if not output.scheduled:
            self._check_progress()
            return None
        timing = timing._replace(
            first_s=timing.first_s + self._carry_s, tail_s=timing.tail_s + self._owed_s
        )
        self._carry_s = self._owed_s = 0.0
        self._step = _Step(output, timing, now, now + timing.total_s)
        self.num_steps += 1
        self.busy_s += timing.total_s
        return self._step.end_s

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
        for scheduled in step.output.scheduled:
            scheduled.request.num_computed_tokens += scheduled.num_new_tokens
            self.kv_cache.cache_blocks(scheduled.request)
        for scheduled in step.output.scheduled:
            request = scheduled.request
            if request.num_computed_tokens != request.num_tokens:
                continue
            request.append_output_token(OUTPUT_TOKEN_ID)
            report.generated.append(request.request_id)
            if request.first_token_time is None:
                request.first_token_time = first_token_s
                report.first_token.append(request.request_id)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                request.finish_time = now
                report.finished.append(request)
        plan = self.kv_cache.take_transfer_plan()
        self._carry_s = self.cost_model.transfer_s(plan)
        self.kv_cache.complete_transfer(plan)
        report.events = self._drain_events()  # this step's events: schedule, cache, stores
        return report

    def _drain_events(self) -> KVEventBatch:
        events = tuple(self.kv_cache.drain_events())
        batch = KVEventBatch(self.replica_index, self._next_seq, events)
        self._next_seq = batch.next_seq
        return batch

    def _check_progress(self) -> None:
        if self.scheduler.running or not self.scheduler.waiting:
            return
        request = self.scheduler.waiting[0]
        raise RuntimeError(
            f"replica {self.replica_index}: request {request.request_id} can never be scheduled: "
            f"it needs {self.kv_cache.num_blocks_needed(request, request.num_tokens)} NPU blocks, "
            f"{self.kv_cache.npu.num_free} are free"
        )
