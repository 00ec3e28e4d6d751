"""The step loop of one replica, independent of what executes a step. No Ray, no tensors here.

``EngineCore.step`` is schedule -> transfer -> execute -> update::

    begin_step()   scheduler.schedule(); submit the plan's copies to the transfer queue and
                   complete those that landed; executor.execute(scheduled) runs the batch and
                   samples a token for every request whose context is now complete
    end_step(..)   num_computed_tokens += new tokens and cache_blocks, in batch order; append
                   each sampled token, stamp the first token, finish on a stop token, a stop
                   string (asked of the text processor, when there is one), max_tokens or
                   max_model_len; submit the stores planned while caching

Speculative decoding (``SchedulerConfig.speculative_ngram``): a decode scheduled with draft
tokens computes its last token and the drafts at once; the executor returns, after its sampled
token, one more token per accepted draft token (``StepResult.extra_token_ids``). The update
counts only the last token as computed at first, then, per extra token, the accepted draft
token before it, and appends and checks each token in turn, exactly as one decode step each::

    before   tokens |... t|            computed |...|        (t: the last token, not computed)
    step     computes t d1 d2 d3; model: g0 after t, g1 after d1, g2 after d2, g3 after d3
    d1 = g0, d2 = g1, d3 != g2  ->  tokens |... t g0 g1 g2|   computed |... t g0 g1|

The KV written for rejected drafts lies past ``num_computed_tokens``: the next step overwrites
it, and only blocks full of computed tokens are ever cached. Blocks allocated for the drafts
stay with the request for its next tokens. How many of its draft tokens were accepted goes
back to the scheduler (``Scheduler.record_drafts``) before a request that finishes is released.

Two executors exist: ``replicas.engine.executor.ModelExecutor`` (the model runner and the
sampler) and the simulator's cost model (``benchmarks/sim/engine.py``), which also splits a step
in simulated time between ``begin_step`` and ``end_step``. Whatever executes it, the update is
this code.
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from replicas.config import SchedulerConfig
from replicas.engine.export_window import ExportWindow
from replicas.engine.prompt_logprobs import PromptLogprobsCache
from replicas.engine.request import Request, RequestStatus
from replicas.engine.scheduler import Scheduler, SchedulerOutput
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import BackingCopy, TransferPlan
from replicas.outputs import TokenLogprob

if TYPE_CHECKING:
    from replicas.engine.model_runner import PromptScores


READ_WAIT_S = 0.02
"""Longest wait for the backing reads in flight in a step that has nothing else to do (it ends
as soon as they have all landed)."""


class StepResult(NamedTuple):
    """What an executor returns: the requests that got a token this step, in batch order, with
    each token's logprob where the request asked for them, and the prompt scores computed;
    with draft tokens, per request the tokens after its sampled one (see the module
    docstring; None: no drafts were verified)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: "list[TokenLogprob | None] | None" = None
    prompt_scores: "tuple[PromptScores, ...] | list[PromptScores]" = ()
    extra_token_ids: list[list[int]] | None = None


@dataclass(slots=True)
class SpecDecodeStats:
    """Draft tokens scheduled for verification, and those the model confirmed."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Executor(Protocol):
    def execute(self, output: SchedulerOutput) -> StepResult:
        """Run the scheduled batch (read before the step's update: ``num_computed_tokens`` is
        where each request starts), after the plan's ``block_copies`` within the NPU tier, and
        sample the requests whose context is complete."""

    def release(self, request_id: str) -> None:
        """Forget a finished request's per-request state (e.g. its random generator)."""


class TransferQueue(Protocol):
    """Copies between tiers (``replicas.kv.transfer.KVTransfer``): plans go in, landed plans
    come out; the core tells the cache manager which landed."""

    def submit(self, plan: TransferPlan) -> None: ...

    def poll(self, wait: bool = False) -> list[TransferPlan]: ...

    def poll_backing(self, timeout: float | None = 0.0) -> "list[tuple[BackingCopy, bool]]":
        """Backing reads that ended (only asked with a backing tier)."""
        ...


class TextProcessor(Protocol):
    """The stop-string half of ``replicas.engine.output_processor.OutputProcessor``."""

    def update(self, request: Request) -> None: ...

    def find_stop(self, request: Request) -> bool: ...


class StepInFlight(NamedTuple):
    output: SchedulerOutput
    result: StepResult


class EngineCore:
    """Requests, scheduler and KV cache of one replica, stepped by an ``Executor``."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache: KVCacheManager,
        executor: Executor,
        *,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        transfer: TransferQueue | None = None,
        text: TextProcessor | None = None,
        prompt_scores: PromptLogprobsCache | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.prompt_scores = prompt_scores
        self.scheduler = Scheduler(
            scheduler_config,
            kv_cache,
            prefix_limit=self._prefix_limit if prompt_scores is not None else None,
            max_model_len=max_model_len,
        )
        self.executor = executor
        self.transfer = transfer
        self.text = text
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._requests: dict[str, Request] = {}
        self.num_scheduled_tokens = 0  # every step's new tokens, since start
        self.spec_decode = SpecDecodeStats()
        self.export_window = ExportWindow()  # open while a forward pass runs

    # ---- requests ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request and free its blocks; None if it is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self.executor.release(request_id)
        request.finish_time = time.monotonic()
        return request

    def shed_waiting(self) -> list[Request]:
        """Abort every waiting request that has produced no token here (its blocks freed), for
        its caller to route elsewhere; returns them. Running requests, and preempted ones that
        produced tokens, stay."""
        shed = [r for r in self.scheduler.waiting if r.first_token_time is None]
        for request in shed:
            self.abort(request.request_id)
        return shed

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (not yet running, or preempted)."""
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; return the requests that got a token (finished ones included)."""
        step = self.begin_step()
        return self.end_step(step) if step is not None else []

    def begin_step(self) -> StepInFlight | None:
        """Schedule, transfer and execute; None when nothing could be scheduled."""
        if self.kv_cache.onboarding.is_on:
            self.complete_backing_loads(0.0)  # reads landed since the last step: admit them now
        self.kv_cache.expire_retained()
        output = self.scheduler.schedule()
        # Counted before this step's transfers: a read landing while they run leaves its
        # request unscheduled this step, which is progress, not a stall.
        onboarding = self.kv_cache.onboarding.num_onboarding
        self.run_transfers(output.transfer)
        if not output.scheduled:
            if onboarding:  # only backing reads to wait for: wait a little
                if self.kv_cache.onboarding.num_onboarding:
                    self.complete_backing_loads(READ_WAIT_S)
            else:
                self._check_progress()
            return None
        self.num_scheduled_tokens += sum(num_new for _, num_new, *_ in output.scheduled)
        if self.prompt_scores is not None:
            for request, *_ in output.scheduled:
                if request.prompt_logprobs is not None:
                    self.prompt_scores.fill(request)  # the scores of a cached prefix
        with self.export_window.forward():  # a peer may read cached blocks meanwhile
            result = self.executor.execute(output)
        return StepInFlight(output, result)

    def _prefix_limit(self, request: Request) -> int | None:
        if request.prompt_logprobs is None:
            return None
        return self.prompt_scores.num_usable_blocks(request)

    def end_step(
        self,
        step: StepInFlight,
        now: float | None = None,
        first_token_time: float | None = None,
    ) -> list[Request]:
        """Apply a step's results (see the module docstring). ``now`` stamps finishes and
        ``first_token_time`` first tokens; both default to the clock."""
        now = time.monotonic() if now is None else now
        first_token_time = now if first_token_time is None else first_token_time
        num_drafted: dict[str, int] = {}
        for request, num_new, *_, drafts in step.output.scheduled:
            request.num_computed_tokens += num_new - len(drafts)  # drafts: once accepted
            self.kv_cache.cache_blocks(request)
            if drafts:
                self.spec_decode.num_draft_tokens += len(drafts)
                num_drafted[request.request_id] = len(drafts)
        result = step.result
        for scores in result.prompt_scores:
            self._add_prompt_scores(step.output.scheduled[scores.index].request, scores)
        logprobs = result.logprobs or [None] * len(result.requests)
        extra = result.extra_token_ids or [()] * len(result.requests)
        for request, token_id, logprob, more in zip(
            result.requests, result.token_ids, logprobs, extra
        ):
            if request.first_token_time is None:
                request.first_token_time = first_token_time
            if request.sampling_params.max_tokens == 0:  # the prompt is scored: done
                status = RequestStatus.FINISHED_LENGTH
            else:
                request.append_output_token(token_id, logprob)
                status = self._check_stop(request, token_id)
            if more:
                self.spec_decode.num_accepted_tokens += len(more)
                status = self._append_accepted(request, more, status)
            if request.request_id in num_drafted:
                self.scheduler.record_drafts(
                    request.request_id, num_drafted[request.request_id], len(more)
                )
            if status is not None:
                self.scheduler.finish(request, status)
                self.executor.release(request.request_id)
                self._requests.pop(request.request_id, None)
                request.finish_time = now
        self.flush_transfers()  # stores of blocks written now
        return result.requests

    def _append_accepted(
        self, request: Request, token_ids: list[int], status: RequestStatus | None
    ) -> RequestStatus | None:
        """Append the tokens an accepted draft gave, one at a time: each makes the draft token
        before it (the request's last token) computed; stop as a decode step would, at the
        first token that ends the request. Then cache the blocks the accepted drafts filled."""
        for token_id in token_ids:
            if status is not None:
                break
            request.num_computed_tokens += 1
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
        self.kv_cache.cache_blocks(request)
        return status

    def _add_prompt_scores(self, request: Request, scores: "PromptScores") -> None:
        """Append the scores of positions not scored yet (a recomputed prefix has them)."""
        known = request.prompt_logprobs
        num_before = len(known)
        skip = num_before - scores.first_position
        if skip < 0:
            raise RuntimeError(f"request {request.request_id}: prompt scores out of order")
        targets = request.prompt_token_ids
        for j in range(skip, len(scores.logprobs)):
            position = scores.first_position + j
            top = tuple(zip(scores.top_ids[j], scores.top_logprobs[j]))
            known.append(TokenLogprob(targets[position], scores.logprobs[j], top))
        if self.prompt_scores is not None:
            self.prompt_scores.record(request, num_before)

    def flush_transfers(self, wait: bool = False) -> None:
        """Run the copies the cache manager planned outside a step's schedule (the stores of
        blocks a step wrote, a reset, a hand-over round): the one place such a plan is taken."""
        self.run_transfers(self.kv_cache.take_transfer_plan(), wait=wait)

    def run_transfers(self, plan: TransferPlan, wait: bool = False) -> None:
        """Submit ``plan`` and tell the cache manager which copies have landed."""
        if self.transfer is None:
            return
        self.transfer.submit(plan)
        for landed in self.transfer.poll(wait=wait):
            self.kv_cache.complete_transfer(landed)
        if self.kv_cache.onboarding.is_on:
            self.complete_backing_loads(None if wait else 0.0)

    def complete_backing_loads(self, timeout: float | None) -> int:
        """Record the backing reads that ended, waiting up to ``timeout`` (None: no bound) for all
        of them; returns how many ended."""
        results = self.transfer.poll_backing(timeout)
        if results:
            self.kv_cache.onboarding.complete_loads(results)
        return len(results)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if self.text is not None:
            self.text.update(request)
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if params.stop and self.text is not None and self.text.find_stop(request):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_progress(self) -> None:
        if self.scheduler.running or not self.scheduler.waiting:
            return
        request = self.scheduler.waiting[0]
        raise RuntimeError(
            f"request {request.request_id} cannot be scheduled with nothing running: it needs "
            f"{self.kv_cache.num_blocks_needed(request, request.num_tokens)} NPU blocks per cache "
            f"type, {self.kv_cache.num_free_npu_blocks()} are free"
        )

    def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget cached blocks nobody uses, in ``tier`` ("all" or a tier's name), once the
        copies in flight have landed."""
        self.flush_transfers(wait=True)
        self.kv_cache.reset_prefix_cache(tier)
