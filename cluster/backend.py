"""What the HTTP API needs from a deployment, and the in-process deployment of one replica.

``RayBackend`` (``cluster.deploy``) serves through the router and replica actors;
``LocalBackend`` runs one engine in this process, for tests and for a single replica without
Ray. The HTTP app sees only the ``Backend`` protocol; the offline ``LLM`` owns one of the two and
also resets prefix caches, checks integrity and shuts it down through it.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from replicas.cache_hints import CacheHints
from replicas.engine.async_engine import AsyncEngine, EngineDeadError
from replicas.engine.async_engine import OverloadedError as OverloadedError  # HTTP 429
from replicas.engine.engine import Engine, EngineStats
from replicas.model import Tokenizer
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams
from router.router import NoLiveReplicaError as NoLiveReplicaError  # no replica is live: HTTP 503


class ReplicaFailedError(RuntimeError):
    """The replica serving a request died or failed while it ran (HTTP 503)."""


class NotScalableError(RuntimeError):
    """The deployment cannot be resized (the in-process engine of one replica; HTTP 409)."""


@dataclass(slots=True)
class ReplicaStats:
    """One replica of the live set. ``engine.num_waiting`` is its waiting queue's length;
    ``load_tokens`` and ``queued_tokens`` are the router's estimate of its load (active context
    tokens; uncached prompt tokens not past prefill), 0 without a router."""

    replica_index: int
    is_alive: bool
    engine: EngineStats | None  # None when the replica did not answer
    load_tokens: int = 0
    queued_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ScaleResult:
    """What one resize did: the size before and after, the replicas added, and the replicas
    removed with why each was chosen (``cluster.scaling``)."""

    old_size: int
    new_size: int
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    reasons: dict[int, str] = field(default_factory=dict)
    """Why each removed replica was chosen, by replica index."""

    def as_dict(self) -> dict[str, object]:
        return {
            "old_data_parallel_size": self.old_size,
            "data_parallel_size": self.new_size,
            "added_replicas": list(self.added),
            "removed_replicas": [
                {"replica": index, "reason": self.reasons.get(index, "")} for index in self.removed
            ],
        }


@dataclass(slots=True)
class FrontStats:
    """What the serving front (this process) spent reaching the replicas of a Ray deployment:
    routing (``num_routes`` requests waited ``route_seconds`` in all for their decisions, sent
    in ``num_route_calls`` coalesced calls) and reading the replicas' output streams
    (``num_stream_messages`` messages of ``num_stream_items`` outputs, ``stream_seconds`` from
    a message being announced to its outputs reaching their requests: fetching and
    deserializing it, dispatching it, and waiting for the event loop in between), and the
    requests resumed on another replica after theirs was lost mid-stream (``num_resumed``)."""

    num_routes: int = 0
    num_route_calls: int = 0
    route_seconds: float = 0.0
    num_stream_messages: int = 0
    num_stream_items: int = 0
    stream_seconds: float = 0.0
    num_resumed: int = 0


@dataclass(slots=True)
class ClusterStats:
    replicas: list[ReplicaStats]  # the live set (starting and retired replicas left out)
    router: Any = None  # router.RouterStats when a router is deployed
    front: FrontStats | None = None  # with a Ray deployment
    num_target_replicas: int = 1  # the size asked for last (live or starting)
    num_scale_events: dict[str, int] = field(default_factory=dict)  # "out"/"in" -> resizes


class Backend(Protocol):
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        cache_hints: CacheHints | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs (cumulative text and tokens, plus this step's delta) until finished.

        Raises before the first output: ``ValueError`` for a prompt the model can never serve,
        ``NoLiveReplicaError`` or ``OverloadedError``. Raises ``ReplicaFailedError`` mid-stream
        if the serving replica dies (and the request cannot be resumed elsewhere). Closing the
        iterator early aborts the request.
        ``cache_hints``: the router's key and the prefix to retain (``replicas.cache_hints``)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def num_live_replicas(self) -> int: ...

    async def stats(self) -> ClusterStats: ...

    async def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget every replica's unreferenced cached blocks of ``tier`` ("all", "npu",
        "host"); a router's index follows through the replicas' KV events."""
        ...

    async def scale(self, data_parallel_size: int, victim: str = "value") -> ScaleResult:
        """Resize to ``data_parallel_size`` replicas without a restart (``cluster.deploy``).
        Raises ``ValueError`` naming why for a bad size, and ``NotScalableError`` when the
        deployment cannot be resized, leaving it as it was; concurrent calls run one after
        another. ``victim``: how a scale-in picks (``cluster.scaling.VICTIM_RULES``; "random"
        is a benchmark baseline)."""
        ...

    def num_replicas(self) -> int:
        """The size asked for last: replicas live or starting."""
        ...


class LocalBackend:
    """One engine in this process (no Ray, no router)."""

    def __init__(
        self,
        engine: Engine,
        model_name: str | None = None,
        max_waiting_requests: int | None = None,
        *,
        step_in_thread: bool = True,
    ) -> None:
        self.engine = engine
        self.async_engine = AsyncEngine(
            engine, max_waiting_requests=max_waiting_requests, step_in_thread=step_in_thread
        )
        self.model_name = model_name or engine.loaded.name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        cache_hints: CacheHints | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = self.async_engine.generate(
            request_id, prompt_token_ids, sampling_params, cache_salt, cache_hints
        )
        try:
            async for output in stream:
                yield output
        except EngineDeadError as error:
            raise ReplicaFailedError(str(error)) from None
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        await self.async_engine.abort(request_id)

    async def num_live_replicas(self) -> int:
        return 0 if self.async_engine.is_dead else 1

    async def stats(self) -> ClusterStats:
        await self.async_engine.between_steps()
        return ClusterStats([ReplicaStats(0, True, self.engine.stats())])

    async def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget cached blocks nobody uses in ``tier`` ("all", "npu", "host", "disk")."""
        await self.async_engine.between_steps()
        self.engine.reset_prefix_cache(tier)

    async def scale(self, data_parallel_size: int, victim: str = "value") -> ScaleResult:
        raise NotScalableError(
            "this deployment runs one replica in-process and cannot be resized; deploy on Ray "
            "to resize it: `strata serve` always does, and LLM.from_config does with "
            "ray.use_for_one_replica: true (or data_parallel_size above 1)"
        )

    def num_replicas(self) -> int:
        return 1

    async def check_integrity(self) -> None:
        """Run every pool's integrity check (raises if one fails)."""
        await self.async_engine.between_steps()
        self.engine.check_integrity()

    async def shutdown(self) -> None:
        await self.async_engine.shutdown()
