"""The offline Python API: ``with LLM("smollm2-135m") as llm: llm.generate(prompts)``.

With ``data_parallel_size=1`` the engine runs in this process. With more, ``LLM`` deploys the
replicas and the router on Ray (embedded local Ray unless one is running) and sends every
prompt through the router, exactly as the HTTP server does.
"""

import asyncio
import itertools
import threading
from collections.abc import Sequence

from cluster.config import ClusterConfig, ModelConfig
from replicas.config import SchedulerConfig
from replicas.engine import Engine, EngineStats
from replicas.model.resolve import DEFAULT_MODEL
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]
Conversation = Sequence[Message]


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
        self.engine: Engine | None = None
        self.backend = None
        if config.data_parallel_size == 1:
            self.engine = Engine(config.engine_config())
            self.tokenizer = self.engine.tokenizer
        else:
            from cluster.deploy import RayBackend

            self.backend = RayBackend(config, name=f"strata-llm-{id(self):x}")
            self.tokenizer = self.backend.tokenizer
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
            self._thread.start()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Run prompts to completion. One prompt (a string or a list of token ids) gives one
        ``RequestOutput``; a list of prompts gives a list, in order."""
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
        if self.engine is not None:
            outputs = self._run_local(request_ids, batch, params, cache_salt)
        else:
            coroutine = self._run_remote(request_ids, batch, params, cache_salt)
            outputs = asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
        return outputs[0] if single else outputs

    def _run_local(
        self,
        request_ids: list[str],
        batch: list[Prompt],
        params: list[SamplingParams],
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        try:
            for request_id, prompt, p in zip(request_ids, batch, params):
                self.engine.add_request(request_id, prompt, p, cache_salt=cache_salt)
            while len(finished) < len(batch):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        finally:
            for request_id in request_ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
        return [finished[request_id] for request_id in request_ids]

    async def _run_remote(
        self,
        request_ids: list[str],
        batch: list[Prompt],
        params: list[SamplingParams],
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        async def one(request_id: str, prompt: Prompt, p: SamplingParams) -> RequestOutput:
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            final = None
            async for output in self.backend.generate(request_id, list(token_ids), p, cache_salt):
                final = output
            final.prompt = prompt if isinstance(prompt, str) else None
            return final

        return list(await asyncio.gather(*map(one, request_ids, batch, params)))

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Answer chats. One conversation (a list of OpenAI-style message dicts, ``{"role":
        ..., "content": ...}``) gives one ``RequestOutput``; a list of conversations gives a
        list, in order. Each is rendered with the model's chat template, ending where the
        assistant's reply begins, then generated like a prompt of ``generate``."""
        single = not conversations or isinstance(conversations[0], dict)
        batch = [conversations] if single else list(conversations)
        prompts = [self._render_chat(conversation) for conversation in batch]
        outputs = self.generate(prompts, sampling_params, cache_salt=cache_salt)
        return outputs[0] if single else outputs

    def _render_chat(self, conversation: Conversation) -> str:
        if not conversation:
            raise ValueError("a conversation needs at least one message")
        for message in conversation:
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise ValueError(
                    f"a chat message is a dict with 'role' and 'content', got {message!r}"
                )
        return self.tokenizer.apply_chat_template([dict(m) for m in conversation])

    def stats(self) -> EngineStats:
        if self.engine is None:
            raise ValueError(
                "stats() reports one in-process engine; with data_parallel_size > "
                "1 use the backend's stats"
            )
        return self.engine.stats()

    def reset_prefix_cache(self, tier: str = "all") -> None:
        self.engine.reset_prefix_cache(tier)

    def check_integrity(self) -> None:
        if self.engine is not None:
            self.engine.check_integrity()
        else:
            self.backend.check_integrity()

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self.backend = None
        self.engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
