"""An asyncio front for one engine: many concurrent streams, one stepping loop.

The engine is not thread-safe, and its step is CPU-bound, so the loop runs each step in a
worker thread and touches the engine from the event loop only between steps::

    event loop:  [apply adds/aborts] --> await step in thread --> [dispatch outputs] --> ...
    callers:     generate() enqueues an add and awaits its queue; abort() enqueues an abort
                 submit() enqueues an add whose outputs go to an ``OutputSink``, which receives
                 every output of a step for all its requests, then one ``flush()``
                 run_exclusive(fn) runs fn on the step thread in place of a step (long engine
                 work, e.g. the disk hand-over of scaling, without blocking the event loop)

A consumer that stops iterating (a disconnected client, a cancelled task) aborts its request,
so every block it held is freed at the next gap between steps.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Protocol, TypeVar

from replicas.cache_hints import CacheHints
from replicas.engine.engine import Engine
from replicas.engine.request_checks import CheckedPrompt
from replicas.outputs import RequestOutput
from replicas.resume import ResumeState
from replicas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OutputSink(Protocol):
    """Where a request's outputs go: ``put`` for each output (or the error that ended the
    request), then ``flush`` once per engine step for every sink that received something."""

    def put(self, request_id: str, item: "RequestOutput | BaseException") -> None: ...

    def flush(self) -> None: ...


class _QueueSink:
    """One request's outputs into an asyncio queue (``AsyncEngine.generate``)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self.queue.put_nowait(item)

    def flush(self) -> None:
        pass


class _Add(NamedTuple):
    request_id: str
    prompt: CheckedPrompt
    sampling_params: SamplingParams
    cache_salt: str | None
    sink: OutputSink
    cache_hints: CacheHints | None = None
    resumed: ResumeState | None = None


class OverloadedError(RuntimeError):
    """The engine's queue of waiting requests is full (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight fails with this error."""


StepHook = Callable[[list[RequestOutput]], None]
ErrorHook = Callable[[BaseException], None]
T = TypeVar("T")


class AsyncEngine:
    """``on_step`` sees every step's outputs; ``on_error`` learns that the loop failed (after
    every stream was told), e.g. to replace the process. ``step_in_thread=False`` runs each
    step on the event loop's own thread, blocking the loop meanwhile: for a caller with nothing
    else to serve (the offline ``LLM``), where a step on the calling thread runs faster than
    on a worker thread."""

    def __init__(
        self,
        engine: Engine,
        on_step: StepHook | None = None,
        on_error: ErrorHook | None = None,
        *,
        replica_index: int = 0,
        max_waiting_requests: int | None = None,
        step_in_thread: bool = True,
    ) -> None:
        self.engine = engine
        self.replica_index = replica_index
        self.max_waiting_requests = max_waiting_requests
        self._step_in_thread = step_in_thread
        # Always the same thread: torch's OpenMP keeps a team of threads per calling thread,
        # so steps hopping over a pool's threads would keep several teams spinning.
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="strata-step")
        self._on_step = on_step
        self._on_error = on_error
        self._sinks: dict[str, OutputSink] = {}
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._exclusive = asyncio.Lock()  # held by a step, or by run_exclusive's work
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self.is_stepping = False

    @property
    def num_requests(self) -> int:
        return len(self._sinks)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: adds queued for the next gap plus the scheduler's queue
        (a burst arriving during one step is all in the former)."""
        return len(self._adds) + self.engine.num_waiting

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        cache_hints: CacheHints | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (stamped with ``replica_index``) until it finishes.
        Validation errors (``ValueError``) and ``OverloadedError``, when
        ``max_waiting_requests`` are waiting already, are raised before anything is yielded."""
        sink = _QueueSink()
        self.submit(request_id, prompt, sampling_params, cache_salt, sink, cache_hints)
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished and self._sinks.pop(request_id, None) is not None:
                self._aborts.append(request_id)
                self._wake.set()

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None,
        sink: OutputSink,
        cache_hints: CacheHints | None = None,
        resumed: ResumeState | None = None,
    ) -> None:
        """Queue a request whose outputs (stamped with ``replica_index``) go to ``sink`` until
        one is finished, or an error ends it. Raises, with nothing queued, what ``generate``
        raises before its first output: here a request enters the replica, so its prompt is
        checked here, once (``Engine.check_prompt``). ``resumed``: the output a lost replica
        generated for it (``replicas.resume``)."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error}")
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting >= limit:
            raise OverloadedError(
                f"replica {self.replica_index} has {limit} requests waiting; retry later"
            )
        if request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        checked = self.engine.check_prompt(prompt)
        self._sinks[request_id] = sink
        self._adds.append(
            _Add(request_id, checked, sampling_params, cache_salt, sink, cache_hints, resumed)
        )
        self._ensure_loop()

    async def between_steps(self) -> None:
        """Return when no step runs, so that the caller may touch the engine (it is not
        thread-safe) until its next await. The first yield lets a loop that was just woken
        apply its commands. Behind a running step it queues for the step lock, so the next
        step waits for it: under load, steps follow each other with no gap to poll for."""
        await asyncio.sleep(0)
        if self.is_stepping:
            async with self._exclusive:
                pass

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (engine work) where steps run, while no step runs: steps wait for it,
        and ``between_steps`` callers too."""
        async with self._exclusive:
            self.is_stepping = True
            try:
                if not self._step_in_thread:
                    return fn()
                return await asyncio.get_running_loop().run_in_executor(self._stepper, fn)
            finally:
                self.is_stepping = False

    async def shed_waiting(self, error: BaseException) -> int:
        """End every request that has not started here with ``error`` (its sink receives it,
        for the caller to route it elsewhere): adds not applied yet, and the engine's waiting
        requests without output (``Engine.shed_waiting``). Returns how many."""
        shed_waiting = await self.run_exclusive(self.engine.shed_waiting)  # steps wait
        adds, self._adds = self._adds, []
        shed = [add.request_id for add in adds] + shed_waiting
        touched: dict[int, OutputSink] = {}
        for request_id in shed:
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink.put(request_id, error)
                touched[id(sink)] = sink
        for sink in touched.values():
            sink.flush()
        return len(shed)

    async def released(self, request_id: str) -> None:
        """Return once a pending abort of ``request_id`` has been applied, so that the id may
        be used again (a request routed back to a replica that is still aborting it)."""
        while request_id in self._aborts and not self.is_dead:
            self._wake.set()
            await asyncio.sleep(0.002)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with an ``abort`` output."""
        self._aborts.append(request_id)
        self._wake.set()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        try:
            while True:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    if not self._adds and not self._aborts:
                        await self._wake.wait()
                    continue
                outputs = await self.run_exclusive(self.engine.step)
                if not self._step_in_thread:
                    await asyncio.sleep(0)  # let callers add and abort between steps
                self._dispatch(outputs)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # every stream must learn of it
            logger.exception("engine loop failed")
            self._error = error
            dead = EngineDeadError(f"engine loop failed: {error}")
            sinks, self._sinks = self._sinks, {}
            for request_id, sink in sinks.items():
                sink.put(request_id, dead)
            for sink in {id(sink): sink for sink in sinks.values()}.values():
                sink.flush()
            if self._on_error is not None:
                self._on_error(error)

    @property
    def is_dead(self) -> bool:
        """Whether the loop failed: every request from now on fails with EngineDeadError."""
        return self._error is not None

    def _apply_commands(self) -> None:
        adds, self._adds = self._adds, []
        for add in adds:
            try:
                self.engine.add_request(
                    add.request_id,
                    add.prompt,
                    add.sampling_params,
                    cache_salt=add.cache_salt,
                    cache_hints=add.cache_hints,
                    resumed=add.resumed,
                )
            except ValueError as error:
                if self._sinks.pop(add.request_id, None) is not None:
                    add.sink.put(add.request_id, error)
                    add.sink.flush()
        aborts, self._aborts = self._aborts, []
        outputs = [out for rid in aborts if (out := self.engine.abort_request(rid)) is not None]
        self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Each output to its request's sink, then one flush per sink that received any."""
        touched: dict[int, OutputSink] = {}
        for output in outputs:
            output.replica_index = self.replica_index
            if output.finished:
                sink = self._sinks.pop(output.request_id, None)
            else:
                sink = self._sinks.get(output.request_id)
            if sink is not None:
                sink.put(output.request_id, output)
                touched[id(sink)] = sink
        for sink in touched.values():
            sink.flush()
        if self._on_step is not None and outputs:
            self._on_step(outputs)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        tiers = getattr(self.engine, "transfer", None) is not None
        self._stepper.shutdown(wait=tiers)  # a step in flight ends before the tiers close
        if tiers:
            self.engine.close()  # copies and disk writes in flight, the pinned slab, disk slabs
