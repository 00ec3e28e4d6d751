"""``ReplicaActor``: one data-parallel replica as a Ray actor, a thin wrapper of its engine.

Callers get outputs one of two ways: ``generate`` streams one request's outputs, one message
per output; ``submit`` + ``outputs`` carry every request of one caller (a subscriber: the HTTP
front's backend) over one stream, one message per engine step holding all their new outputs, so
the cost of the transport does not grow with the number of requests in a batch. After every
engine step the actor reports to the router (fire-and-forget, in order): the step's KV events
with this replica's sequence numbers, the tokens each request generated, and the requests that
ended. A restarted actor starts with an empty cache and sequence 0; the router resynchronises
from ``snapshot()`` on any gap. When the router's ttft profile has no cost profile, each replica
times its own engine steps when it starts (``replicas.calibration``), before it records any KV
event.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import ray

from replicas.cache_hints import CacheHints, PeerSource
from replicas.kv.events import KVEventBatch, KVSnapshot, Tier
from replicas.kv.hashing import BlockHash
from replicas.outputs import OutputDelta, RequestOutput
from replicas.pull_costs import start_report
from replicas.resume import ResumeState
from replicas.sampling_params import SamplingParams
from replicas.step_costs import StepCosts

# The engine (and torch) are imported where a replica starts, not with this module: every
# process that deserializes a replica's actor handle imports this module (Ray loads the actor's
# class to know its methods), the router among them, which must stay free of torch.
if TYPE_CHECKING:
    from replicas.config import EngineConfig
    from replicas.engine.engine import EngineStats

logger = logging.getLogger(__name__)


EXIT_DELAY_S = 2.0
"""How long a replica whose engine failed keeps its process, so that the errors of its requests
reach their callers; meanwhile it turns new requests away as unavailable."""


def placed_device(device: str) -> str:
    """The device a replica actor runs on. With ``auto`` it follows the actor's placement bundle:
    CUDA when the bundle reserves a GPU (Ray then makes that GPU the only one visible, so it is
    ``cuda``), the CPU when it reserves none: Ray leaves every GPU of the node visible to an actor
    that asked for none, and a replica must not take a GPU that another one reserved. Outside a
    Ray worker, or with an explicit device, ``device`` is kept."""
    if not ray.is_initialized():
        return device
    has_gpu = bool(ray.get_gpu_ids())
    if device == "auto":
        return "cuda" if has_gpu else "cpu"
    if device.startswith("cuda") and not has_gpu:
        logger.warning(
            "device=%s but this replica's placement bundle reserves no GPU: set "
            "ray.gpus_per_replica so that replicas do not share a GPU unknowingly",
            device,
        )
    return device


def _stream_number(subscriber: str) -> int:
    number = subscriber.rpartition(":")[2]
    return int(number) if number.isdigit() else -1


StreamItem = tuple[str, tuple | BaseException]
"""``(request_id, error)``, or ``(request_id, OutputDelta.values_of(output))``."""


class _Subscriber:
    """One subscriber's requests on this replica: what each engine step added to their outputs,
    batched for the subscriber's ``outputs`` stream (an ``OutputSink``)."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()
        self.batches: asyncio.Queue[list[StreamItem] | None] = asyncio.Queue()
        self._pending: list[StreamItem] = []

    def put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._pending.append((request_id, item))
            self.request_ids.discard(request_id)
            return
        self._pending.append((request_id, OutputDelta.values_of(item)))
        if item.finished:
            self.request_ids.discard(request_id)

    def flush(self) -> None:
        if self._pending:
            self.batches.put_nowait(self._pending)
            self._pending = []

    def close(self) -> None:
        self.batches.put_nowait(None)


class ReplicaUnavailableError(RuntimeError):
    """The request never ran here, so it may go to another replica: the replica's engine failed
    and the replica is about to restart, or the replica is draining (``shed_waiting``)."""


DRAINING = "replica is draining"
"""The message of the error that ends the requests a draining replica sheds."""


def _log_to_the_driver() -> None:
    """Send this process's ``replicas.*`` INFO records (start-up, tuning hints) to stderr,
    which Ray forwards to the driver: the server's log. Without a handler Python would drop
    them (its last-resort handler prints warnings only)."""
    package = logging.getLogger("replicas")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)
        package.propagate = False


class ReplicaActor:
    def __init__(
        self,
        replica_index: int,
        engine_config: EngineConfig,
        router: Any = None,
        max_waiting_requests: int | None = None,
        measure_costs: bool = False,
    ) -> None:
        from replicas.calibration import measure_step_costs
        from replicas.engine.async_engine import AsyncEngine
        from replicas.engine.engine import Engine
        from replicas.model.autotune import SCOPE_ENV

        self.replica_index = replica_index
        _log_to_the_driver()
        device = placed_device(engine_config.device)
        if device != engine_config.device:
            engine_config = engine_config.model_copy(update={"device": device})
        # The deployment's replicas (and their restarts) share one job: and so one ``auto`` choice;
        # a scope the environment names already (a deployment spanning jobs) is kept.
        os.environ.setdefault(SCOPE_ENV, f"ray-job-{ray.get_runtime_context().get_job_id()}")
        self.engine = Engine(engine_config)
        # Before any KV event is recorded: the samples' blocks never reach the router.
        self._step_costs = measure_step_costs(self.engine) if measure_costs else None
        self.engine.kv_cache.views.enable_events()
        self.async_engine = AsyncEngine(
            self.engine,
            on_step=self._report,
            on_error=self._exit_for_restart,
            replica_index=replica_index,
            max_waiting_requests=max_waiting_requests,
        )
        self.router = router
        self._pull_costs = start_report(self.engine, replica_index, self._step_costs, router)
        self._subscribers: dict[str, _Subscriber] = {}
        self._latest_streams: dict[str, int] = {}  # owner -> its latest stream's number
        self._next_seq = 0
        self.incarnation = uuid.uuid4().hex  # tells a restarted actor from the one before
        self._exporter = ThreadPoolExecutor(1, thread_name_prefix="kv-export")  # peers' reads
        self._published_backing = False  # ready() published the backing tiers' blocks

    # ---- serving -----------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        cache_hints: CacheHints | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streaming generator (call with ``num_returns="streaming"``); ``OverloadedError``
        when the waiting queue is full."""
        self._check_engine()
        stream = self.async_engine.generate(
            request_id, prompt_token_ids, sampling_params, cache_salt, cache_hints
        )
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def submit(
        self,
        subscriber: str,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        cache_hints: CacheHints | None = None,
        resumed: ResumeState | None = None,
    ) -> None:
        """Queue a request whose outputs go to ``subscriber``'s ``outputs`` stream. Raises, with
        nothing queued: ``OverloadedError`` (waiting queue full), ``ValueError`` (bad request),
        ``ReplicaUnavailableError`` (this replica's engine failed). ``resumed``: the output a
        lost replica generated for it (``replicas.resume``)."""
        self._check_engine()
        channel = self._subscriber(subscriber)
        await self.async_engine.released(request_id)  # aborted here before it was routed back
        self.async_engine.submit(
            request_id, prompt_token_ids, sampling_params, cache_salt, channel, cache_hints, resumed
        )
        channel.request_ids.add(request_id)

    async def outputs(self, subscriber: str) -> AsyncIterator[list[StreamItem]]:
        """Streaming generator (call with ``num_returns="streaming"``) of ``subscriber``'s
        outputs: one list per message of ``StreamItem``s, in the order the engine produced
        them; batches that queued up while the caller was reading go out as
        one. A subscriber is ``"<owner>:<n>"``: opening ``n`` ends the stream of every earlier
        one of the same owner and aborts its requests (the owner lost that stream)."""
        owner, _, _ = subscriber.rpartition(":")
        number = _stream_number(subscriber)
        self._latest_streams[owner] = max(number, self._latest_streams.get(owner, number))
        for name in [n for n in self._subscribers if n.rpartition(":")[0] == owner]:
            if _stream_number(name) < number:
                await self._drop_subscriber(name)
        channel = self._subscriber(subscriber)
        try:
            while (batch := await channel.batches.get()) is not None:
                while not channel.batches.empty():
                    more = channel.batches.get_nowait()
                    if more is None:
                        yield batch
                        return
                    batch.extend(more)
                yield batch
        finally:
            if self._subscribers.get(subscriber) is channel:
                await self._drop_subscriber(subscriber)

    def _subscriber(self, name: str) -> _Subscriber:
        channel = self._subscribers.get(name)
        if channel is None:
            owner, _, _ = name.rpartition(":")
            if _stream_number(name) < self._latest_streams.get(owner, -1):
                raise RuntimeError(f"output stream {name!r} was replaced by a newer one")
            channel = self._subscribers[name] = _Subscriber()
        return channel

    async def _drop_subscriber(self, name: str) -> None:
        """Forget a subscriber whose stream is gone: nobody can receive its requests' outputs,
        so they are aborted (every block they held is freed)."""
        channel = self._subscribers.pop(name)
        channel.close()
        for request_id in list(channel.request_ids):
            await self.async_engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await self.async_engine.abort(request_id)

    def _exit_for_restart(self, error: BaseException) -> None:
        """The engine loop failed, so this replica can serve nothing more: leave its requests a
        moment to receive their errors, then end the process so that Ray restarts the replica
        with a fresh engine (a crash fails only the requests it held)."""
        logger.error(
            "replica %d: engine loop failed (%r); exiting so that Ray restarts it",
            self.replica_index,
            error,
        )
        asyncio.get_running_loop().call_later(EXIT_DELAY_S, os._exit, 1)

    def _check_engine(self) -> None:
        if self.async_engine.is_dead:
            raise ReplicaUnavailableError(
                f"replica {self.replica_index}'s engine failed; the replica is restarting"
            )

    # ---- router support ----------------------------------------------------------------------
    def _report(self, outputs: list[RequestOutput]) -> None:
        events = tuple(self.engine.kv_cache.views.drain_events())
        batch = KVEventBatch(self.replica_index, self._next_seq, events)
        self._next_seq = batch.next_seq
        generated = {o.request_id: len(o.new_token_ids) for o in outputs if o.new_token_ids}
        finished = [o.request_id for o in outputs if o.finished]
        if self.router is not None and (events or generated or finished):
            self.router.report.remote(batch, generated, finished)
        if self._pull_costs is not None:
            self._pull_costs.maybe_send()

    async def snapshot(self) -> KVSnapshot:
        """Every cached hash per tier, consistent with the events published so far."""
        await self.async_engine.between_steps()
        self._report([])  # publish what is pending so the snapshot follows it
        return self.engine.kv_cache.views.snapshot(self.replica_index, self._next_seq)

    # ---- introspection -----------------------------------------------------------------------
    async def info(self) -> dict[str, int | str]:
        import torch

        return {
            "replica_index": self.replica_index,
            "max_model_len": self.engine.max_model_len,
            "block_size": self.engine.block_size,
            "num_npu_blocks": self.engine.num_npu_blocks,
            "model": self.engine.loaded.name,
            "device": str(self.engine.device),
            "num_threads": torch.get_num_threads(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    async def ready(self) -> str:
        """This actor's incarnation id: it changes when Ray restarts the replica. Raises
        ``ReplicaUnavailableError`` while a failed replica waits to exit. With a disk tier, the
        blocks it took back from its slab are published at the first call, before any
        traffic; later calls (the health monitor's pings) answer at once, whatever step runs."""
        self._check_engine()
        if self.engine.backing and not self._published_backing:
            await self.async_engine.between_steps()
            self._report([])
            self._published_backing = True
        return self.incarnation

    async def export_blocks(self, cache_type: str, hashes: list[BlockHash]) -> tuple:
        """The blocks of ``cache_type`` this replica holds by hash, for a replica pulling them
        through its peer tier (``Engine.export_blocks``): read while a step computes, where
        the engine allows it (``replicas.engine.export_window``), else between steps."""
        from replicas.engine.export_window import export_in_step

        self._check_engine()
        if self.engine.exports_in_steps:
            done, answer = await export_in_step(
                lambda: self.async_engine.is_stepping,
                self.engine.core.export_window,
                lambda: self.engine.export_blocks(cache_type, hashes, in_step=True),
                self._exporter,
            )
            if done:
                return answer
        return await self.async_engine.run_exclusive(
            lambda: self.engine.export_blocks(cache_type, hashes)
        )

    async def export_probe(self, cache_type: str, num_blocks: int) -> tuple:
        """Blocks of zeros shaped as ``cache_type``'s, for a replica timing a pull from this one
        (``replicas.kv.tiers.peer.PeerStore.probe``)."""
        from replicas.kv.tiers.peer import probe_answer

        self._check_engine()
        return probe_answer(self.engine, cache_type, num_blocks)

    async def probe_peer(self, peer: Any) -> bool:
        """Time pulls from the replica ``peer`` (its actor) so that this replica prices its
        first pull with a measured round trip and rate (``PeerStore.probe``), then report its
        pull costs; False without the peer tier or if ``peer`` did not answer."""
        stores = self.engine.backing.get("peer", {})
        loop = asyncio.get_running_loop()
        answered = [await loop.run_in_executor(None, s.probe, peer) for s in stores.values()]
        if self._pull_costs is not None:
            self._pull_costs.send_now()
        return bool(answered) and all(answered)

    async def step_costs(self) -> StepCosts | None:
        """What this replica's engine steps cost, measured when it started (None unless the
        deployment asked: the router's ttft profile without a configured cost profile)."""
        return self._step_costs

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def check_integrity(self) -> dict[str, int]:
        """Run every pool's integrity check between steps; report blocks in use."""
        await self.async_engine.between_steps()
        self.engine.check_integrity()
        primary = next(iter(self.engine.kv_cache.views.usage().values()))
        return {
            "npu_blocks_used": primary.of(Tier.NPU).num_used,
            "host_blocks_used": primary.of(Tier.HOST).num_used,
            "num_unfinished": self.engine.num_unfinished,
        }

    # ---- scaling (``replicas.kv.handover``) ------------------------------------------------------
    async def hot_blocks(self) -> dict[BlockHash, float]:
        """Every block hash the router indexes for this replica in its NPU or host tier, with
        its recent-hit weight (``replicas.kv.hotness``; 0.0: held, not hit recently)."""
        return await self.async_engine.run_exclusive(self.engine.hot_blocks)  # steps wait

    async def shed_waiting(self) -> int:
        """End every request that has produced no output here with
        ``ReplicaUnavailableError("replica is draining")``, so that its caller routes it
        elsewhere; returns how many. Running requests continue."""
        return await self.async_engine.shed_waiting(ReplicaUnavailableError(DRAINING))

    async def write_hot_blocks_to_disk(self, time_budget_s: float) -> int:
        """Write the NPU and host blocks the node's disk tier lacks to this replica's slab,
        hottest first, until done or ``time_budget_s`` passes (steps wait meanwhile); returns
        the blocks written, their writes landed (0 without a disk tier)."""
        num_written = await self.async_engine.run_exclusive(
            lambda: self.engine.write_hot_blocks_to_disk(time_budget_s)
        )
        await self.async_engine.between_steps()
        self._report([])  # the disk tier's new blocks
        logger.info("replica %d: %d blocks written to disk", self.replica_index, num_written)
        return num_written

    async def warm_from_disk(self, time_budget_s: float) -> int:
        """Load the node's disk blocks into empty host blocks, hottest first, within
        ``time_budget_s``, and announce them to the router; returns the blocks loaded (0
        without a disk or host tier). Call before the replica takes traffic."""
        num_loaded = await self.async_engine.run_exclusive(
            lambda: self.engine.warm_from_disk(time_budget_s)
        )
        await self.async_engine.between_steps()
        self._report([])  # the host blocks, before any request is routed here
        logger.info("replica %d: %d blocks loaded from disk", self.replica_index, num_loaded)
        return num_loaded

    async def warm_from_peers(
        self,
        sources: list[tuple[int, Any, dict[BlockHash, float]]],
        time_budget_s: float,
        max_share: float = 0.0,
    ) -> int:
        """Pull other replicas' blocks into the host tier through the peer tier, hottest first
        (``Engine.warm_from_peers``; each source: its index, its actor handle and the hashes
        to ask it for with their hit weights), within ``time_budget_s``, and announce them to
        the router; returns the blocks loaded (0 without a peer or host tier)."""
        peers = [(PeerSource(index, handle, 0), weights) for index, handle, weights in sources]
        num_loaded = await self.async_engine.run_exclusive(
            lambda: self.engine.warm_from_peers(peers, time_budget_s, max_share)
        )
        await self.async_engine.between_steps()
        self._report([])  # the host blocks, routable at once
        logger.info(
            "replica %d: %d blocks pulled from replicas %s",
            self.replica_index,
            num_loaded,
            [index for index, _, _ in sources],
        )
        return num_loaded

    async def reset_prefix_cache(self, tier: str = "all") -> None:
        await self.async_engine.between_steps()
        self.engine.reset_prefix_cache(tier)
        self._report([])
