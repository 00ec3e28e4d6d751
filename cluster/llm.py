"""The offline Python API: ``with LLM("smollm2-135m") as llm: llm.generate(prompts)``.

``LLM`` picks its backend once, at construction: with ``data_parallel_size=1`` a
``LocalBackend`` runs the engine in this process; with more (or with ``ray.use_for_one_replica``
or a ``scaling`` section in the config), a ``RayBackend`` deploys the replicas and the router on
Ray (embedded local Ray unless one is running) and every prompt goes through the router, exactly
as in the HTTP server; only that deployment can be resized (``LLM.scale``). Either way the same
code drives it: the backend's coroutines run on an event loop that the ``LLM`` owns, on the
calling thread for the length of each call (``_EventLoop``).
"""

import asyncio
import contextlib
import itertools
import weakref
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from cluster.backend import LocalBackend, ReplicaFailedError, ReplicaStats, ScaleResult
from cluster.choices import generate_choices
from cluster.config import ClusterConfig, ModelConfig
from replicas.config import SchedulerConfig
from replicas.engine.engine import Engine, EngineStats, sum_stats
from replicas.model.resolve import DEFAULT_MODEL
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.deploy import RayBackend

Prompt = str | list[int]
Message = dict[str, str]
Conversation = Sequence[Message]
ParamsArg = SamplingParams | Sequence[SamplingParams] | None
"""One ``SamplingParams`` for every prompt, one per prompt, or None for the defaults."""
T = TypeVar("T")


class LLM:
    """Generate completions offline; see the module docstring."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        seed: int = 0,
        block_size: int = 16,
        num_npu_blocks: int | None = None,
        max_model_len: int | None = None,
        scheduler_config: SchedulerConfig | None = None,
        data_parallel_size: int = 1,
        **engine_options: object,
    ) -> None:
        config = ClusterConfig(
            data_parallel_size=data_parallel_size,
            model=ModelConfig(
                model=model,
                seed=seed,
                block_size=block_size,
                num_npu_blocks=num_npu_blocks,
                max_model_len=max_model_len,
                **engine_options,
            ),
            scheduler=scheduler_config or SchedulerConfig(),
        )
        self._setup(config)

    @classmethod
    def from_config(cls, config: ClusterConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._setup(config)
        return llm

    def _setup(self, config: ClusterConfig) -> None:
        self.config = config
        self._ids = itertools.count()
        self.backend: LocalBackend | RayBackend | None = _start_backend(
            config, name=f"strata-llm-{id(self):x}"
        )
        self.tokenizer = self.backend.tokenizer
        self._loop = _EventLoop()
        if config.scaling is not None:  # the policy's ticks advance while a call runs
            from cluster.autoscale import Autoscaler

            autoscaler = Autoscaler(config.scaling, config.scheduler.max_num_seqs)
            self._loop.loop.create_task(autoscaler.run(self.backend))
        # An LLM dropped without shutdown() cancels the backend's tasks, freeing the engine.
        weakref.finalize(self, self._loop.stop)

    @property
    def engine(self) -> Engine | None:
        """The in-process engine with ``data_parallel_size=1`` (for tests and benchmarks that
        look inside it); None when the replicas run on Ray or after ``shutdown()``."""
        return getattr(self.backend, "engine", None)

    # ---- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: ParamsArg = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Run prompts to completion. One prompt (a string or a list of token ids) gives one
        ``RequestOutput``; a list of prompts gives a list, in order. With ``n`` (or
        ``best_of``) above one, each prompt gives a list of its ``n`` choices instead
        (``cluster.choices``: the prompt is prefilled once)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and (not prompts or isinstance(prompts[0], int))
        )
        batch: list[Prompt] = [prompts] if single else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(
                    f"got {len(params)} sampling_params for {len(batch)} prompts; pass one "
                    "SamplingParams or one per prompt"
                )
        request_ids = [f"llm-{next(self._ids)}" for _ in batch]
        outputs = self._loop.run(self._generate_all(request_ids, batch, params, cache_salt))
        return outputs[0] if single else outputs

    async def _generate_all(
        self,
        request_ids: list[str],
        batch: list[Prompt],
        params: list[SamplingParams],
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        """Every prompt's final output, in order. All requests reach the backend before its
        first step. If one fails, the others are cancelled (aborting their requests) first."""
        tasks = [
            asyncio.ensure_future(self._generate_one(request_id, prompt, p, cache_salt))
            for request_id, prompt, p in zip(request_ids, batch, params)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _generate_one(
        self, request_id: str, prompt: Prompt, params: SamplingParams, cache_salt: str | None
    ) -> RequestOutput | list[RequestOutput]:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.num_sequences > 1:
            (choices,) = await generate_choices(
                self.backend, request_id, [token_ids], params, cache_salt
            )
            for choice in choices:
                choice.prompt = prompt if isinstance(prompt, str) else None
            return choices
        final = None
        async for output in self.backend.generate(request_id, token_ids, params, cache_salt):
            final = output
        final.prompt = prompt if isinstance(prompt, str) else None
        return final

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: ParamsArg = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Answer chats. One conversation (a list of OpenAI-style message dicts, ``{"role":
        ..., "content": ...}``) gives one ``RequestOutput``; a list of conversations gives a
        list, in order. Each is rendered with the model's chat template, ending where the
        assistant's reply begins, then generated like a prompt of ``generate``."""
        if not conversations or isinstance(conversations[0], dict):  # one conversation
            prompts: Prompt | list[Prompt] = self._render_chat(conversations)
        else:
            prompts = [self._render_chat(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, cache_salt=cache_salt)

    def _render_chat(self, conversation: Conversation) -> str:
        if not conversation:
            raise ValueError("a conversation needs at least one message")
        for message in conversation:
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise ValueError(
                    f"a chat message is a dict with 'role' and 'content', got {message!r}"
                )
        return self.tokenizer.apply_chat_template([dict(m) for m in conversation])

    # ---- admin -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The engine's statistics; with several replicas, their sum (counters, gauges and
        block usage per cache type). Raises if a replica did not answer."""
        return sum_stats([r.engine for r in self.replica_stats()])

    def replica_stats(self) -> list[ReplicaStats]:
        """Each replica's statistics. Raises ``ReplicaFailedError`` if one did not answer."""
        replicas = self._loop.run(self.backend.stats()).replicas
        silent = [r.replica_index for r in replicas if r.engine is None]
        if silent:
            raise ReplicaFailedError(f"replicas {silent} did not report their stats")
        return replicas

    def scale(self, data_parallel_size: int, victim: str = "value") -> ScaleResult:
        """Resize the deployment to ``data_parallel_size`` replicas without a restart: a new
        replica warms its host tier from its node's disk and takes traffic once ready; the
        replica removed is the one whose cached blocks the others miss least, drained first
        (``cluster.deploy``). Raises ``ValueError`` naming why for a bad size and
        ``NotScalableError`` for the in-process replica, leaving the deployment as it was.
        ``victim="random"`` removes random replicas instead: a baseline for benchmarks."""
        return self._loop.run(self.backend.scale(data_parallel_size, victim))

    def num_replicas(self) -> int:
        """The size asked for last: replicas live or starting."""
        return self.backend.num_replicas()

    def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget the cached blocks nobody uses in ``tier`` ("all", "npu", "host", "disk"), on every
        replica."""
        self._loop.run(self.backend.reset_prefix_cache(tier))

    def check_integrity(self) -> None:
        """Run every replica's integrity checks; raises if one fails."""
        self._loop.run(self.backend.check_integrity())

    def shutdown(self) -> None:
        """Stop the backend (the engine loop, or the Ray actors) and close the event loop."""
        if self.backend is None:
            return
        self._loop.run(_shut_down(self.backend))
        self._loop.stop()
        self.backend = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _start_backend(config: ClusterConfig, name: str) -> "LocalBackend | RayBackend":
    """One replica runs in this process; more, or any number under an autoscaling policy or
    with ``ray.use_for_one_replica``, are deployed on Ray as actors named ``name-*``."""
    resizable = config.ray.use_for_one_replica or config.scaling is not None
    if config.data_parallel_size == 1 and not resizable:
        # Steps on the calling thread: no worker-thread hop, nothing else to serve meanwhile.
        return LocalBackend(Engine(config.engine_config()), step_in_thread=False)
    from cluster.deploy import RayBackend  # imports Ray

    return RayBackend(config, name=name)


async def _shut_down(backend: "LocalBackend | RayBackend") -> None:
    """``LocalBackend.shutdown`` is a coroutine (it stops the engine loop on this event loop);
    ``RayBackend.shutdown`` is not (its other callers are synchronous)."""
    stopping = backend.shutdown()
    if stopping is not None:
        await stopping


class _EventLoop:
    """The ``LLM``'s event loop, run on the calling thread for the length of each call (so the
    engine steps where the caller's torch threads are), or, when that thread already runs an
    event loop (a notebook, async code), on a worker thread for that call. The backend's
    background tasks (the engine loop, the health monitor) live on it and advance during calls;
    ``stop`` cancels them and closes the loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` to its result. Interrupted (Ctrl-C), it cancels the coroutine,
        which aborts its requests."""
        return self._on_a_free_thread(self._run, coroutine)

    def stop(self) -> None:
        if not self.loop.is_closed():
            self._on_a_free_thread(self._close)

    @staticmethod
    def _on_a_free_thread(function: Callable[..., T], *args: Any) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop runs on this thread: run ours here
            return function(*args)
        with ThreadPoolExecutor(1, thread_name_prefix="strata-llm") as pool:
            return pool.submit(function, *args).result()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        task = self.loop.create_task(coroutine)
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            task.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(task)
            raise

    def _close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.loop.run_until_complete(cancel_all())
        self.loop.close()
