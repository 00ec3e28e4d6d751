"""One replica's outputs into this process over a single stream.

``ReplicaLink`` keeps one streaming call open to a replica's ``outputs`` and hands every output
to the request it belongs to; requests reach the replica by ``submit``, fire-and-forget::

    generate(r1) ─submit──▶ ReplicaActor ──outputs stream: one message per engine step──▶ pump
    generate(r2) ─submit──▶      │              [(r1, out), (r2, out), ...]                  │
         ▲                       │                                                         │
         └────────────── per-request queue ◀────────────────────────────────────────────────┘

So a batch of requests costs one message per step, not one per token per request, and the
message holds only what the step added (``OutputDelta``: no prompt, no tokens or text sent
before); the link adds them up into each request's ``RequestOutput``. A request
learns of every failure: ``submit`` raising (turned away, bad request, the replica gone) and the
stream breaking (the replica lost) both end up in its queue.
"""

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayTaskError

from cluster.health import ACTOR_LOST
from replicas.cache_hints import CacheHints
from replicas.outputs import OutputAccumulator, OutputDelta, RequestOutput
from replicas.resume import ResumeState
from replicas.sampling_params import SamplingParams


class StreamLostError(RuntimeError):
    """The replica ended its output stream: it can no longer deliver this request's outputs."""


class ReplicaLink:
    """Requests on one replica actor from this process, their outputs over one stream. A lost
    stream fails the requests it carried; the next request opens a new one (with a new number,
    which makes the replica drop the old one and abort what it still ran for it)."""

    def __init__(self, replica: Any, owner: str | None = None) -> None:
        self.replica = replica
        self.owner = owner or uuid.uuid4().hex
        self._numbers = itertools.count(1)
        self._subscriber = ""
        self._queues: dict[str, asyncio.Queue] = {}
        self._pump: asyncio.Task | None = None
        self.num_messages = 0  # stream messages received
        self.num_items = 0  # outputs and errors they carried
        self.seconds = 0.0  # from each message's announcement to its outputs handed over

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None,
        cache_hints: CacheHints | None = None,
        resumed: RequestOutput | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until one is finished. Raises what the replica raised:
        ``RayTaskError`` (turned away or invalid, its ``cause`` says which), an error the
        engine ended the request with, or a loss (``ACTOR_LOST``, ``StreamLostError``).
        ``resumed``: the request's last output from a replica that was lost; the replica
        continues it (``replicas.resume``) and the outputs continue from it."""
        self._ensure_pump()
        outputs = OutputAccumulator(prompt_token_ids, resumed)
        state = ResumeState.of(resumed) if resumed is not None else None
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        ack = asyncio.ensure_future(
            self._submit(
                self._subscriber,
                queue,
                request_id,
                prompt_token_ids,
                sampling_params,
                cache_salt,
                cache_hints,
                state,
            )
        )
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                output = outputs.add(OutputDelta._make(item))
                yield output
                if output.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            ack.cancel()

    def abort(self, request_id: str) -> None:
        """Ask the replica to stop ``request_id`` and free its blocks, fire-and-forget (a lost
        replica has nothing to free; a restarted one may have it queued)."""
        self.replica.abort.remote(request_id)

    async def _submit(
        self,
        subscriber: str,
        queue: asyncio.Queue,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None,
        cache_hints: CacheHints | None,
        resumed: ResumeState | None,
    ) -> None:
        try:
            await self.replica.submit.remote(
                subscriber,
                request_id,
                prompt_token_ids,
                sampling_params,
                cache_salt,
                cache_hints,
                resumed,
            )
        except (RayTaskError, *ACTOR_LOST) as error:  # never queued there
            queue.put_nowait(error)

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._subscriber = f"{self.owner}:{next(self._numbers)}"
            self._pump = asyncio.get_running_loop().create_task(self._run(self._subscriber))

    async def _run(self, subscriber: str) -> None:
        error: BaseException = StreamLostError(f"output stream {subscriber} ended")
        try:
            stream = self.replica.outputs.options(num_returns="streaming").remote(subscriber)
            async for ref in stream:
                start = time.perf_counter()
                batch = await ref  # fetch and deserialize; other tasks may run meanwhile
                for request_id, item in batch:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
                self.num_messages += 1
                self.num_items += len(batch)
                self.seconds += time.perf_counter() - start
        except ACTOR_LOST as lost:
            error = lost
        except Exception as failed:  # whatever broke the stream ends the requests it carried
            cause = failed.cause if isinstance(failed, RayTaskError) else failed
            error = StreamLostError(f"output stream {subscriber} failed: {cause!r}")
        for queue in self._queues.values():  # every request this stream carried
            queue.put_nowait(error)
