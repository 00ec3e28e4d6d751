"""The offline Python API: ``with LLM("tiny") as llm: llm.generate(prompts)``."""

import itertools
from collections.abc import Sequence

from replicas.config import EngineConfig, SchedulerConfig
from replicas.engine import Engine, EngineStats
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate completions in-process.

    ``data_parallel_size`` greater than 1 needs the Ray deployment of replicas and router, which
    this build does not include yet; it is rejected rather than silently run on one replica.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        seed: int = 0,
        block_size: int = 16,
        num_npu_blocks: int | None = None,
        max_model_len: int | None = None,
        scheduler_config: SchedulerConfig | None = None,
        data_parallel_size: int = 1,
        **engine_options: object,
    ) -> None:
        if data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={data_parallel_size} is not supported by the in-process "
                "LLM yet; use data_parallel_size=1"
            )
        config = EngineConfig(
            model=model,
            seed=seed,
            block_size=block_size,
            num_npu_blocks=num_npu_blocks,
            max_model_len=max_model_len,
            scheduler_config=scheduler_config or SchedulerConfig(),
            **engine_options,
        )
        self.engine = Engine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

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
        outputs = [finished[request_id] for request_id in request_ids]
        return outputs[0] if single else outputs

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self, tier: str = "all") -> None:
        self.engine.reset_prefix_cache(tier)

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def shutdown(self) -> None:
        self.engine = None  # type: ignore[assignment]

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
