"""A request's choices: ``n`` (or ``best_of``) sequences for each of its prompts, each
prompt prefilled once.

The engine serves one sequence per request, so a request with several is fanned out here, for
the HTTP API and ``LLM`` alike::

    prompt p:  sequence 0 --first output--> sequences 1 .. k-1 start
               (its prompt's full blocks are cached by then; the router sends the others to
               the replica holding them, and each computes only the prompt's last partial block)

Sequence ``i`` of a seeded request draws with ``seed + i``, so choices differ and each is
reproducible. Only sequence 0 scores the prompt (``prompt_logprobs``). ``best_of`` keeps the
``n`` sequences of highest cumulative log-probability, which asks the engine for the sampled
tokens' logprobs (dropped again unless the caller wanted them).
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

from cluster.backend import Backend, ReplicaFailedError
from replicas.cache_hints import CacheHints
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams

_SEED_RANGE = 2**64


class SequenceOutput(NamedTuple):
    prompt_index: int
    sequence_index: int
    output: RequestOutput


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """The engine's parameters for sequence ``index`` of a request with ``params``."""
    seed = params.seed
    if seed is not None and index:
        seed = (seed + index + 2**63) % _SEED_RANGE - 2**63
    logprobs = params.logprobs
    if params.num_sequences > params.n and logprobs is None:
        logprobs = 0
    return dataclasses.replace(
        params,
        n=1,
        best_of=None,
        seed=seed,
        logprobs=logprobs,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


async def generate_sequences(
    backend: Backend,
    request_id: str,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    cache_salt: str | None = None,
    cache_hints: CacheHints | None = None,
) -> AsyncIterator[SequenceOutput]:
    """Every output of every sequence, as they come. A failure of any sequence ends the
    iteration with its error; closing the iterator aborts every sequence still running."""
    num_sequences = params.num_sequences
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(prompt_index: int, index: int) -> None:
        sequence_id = (
            request_id
            if len(prompts) == 1 and num_sequences == 1
            else (f"{request_id}-{prompt_index}-{index}")
        )
        try:
            async for output in backend.generate(
                sequence_id,
                prompts[prompt_index],
                sequence_params(params, index),
                cache_salt,
                cache_hints,
            ):
                queue.put_nowait((prompt_index, index, output))
        except Exception as error:
            queue.put_nowait((prompt_index, index, error))
        else:
            queue.put_nowait((prompt_index, index, None))

    def start(prompt_index: int, index: int) -> None:
        tasks.append(asyncio.ensure_future(pump(prompt_index, index)))

    for prompt_index in range(len(prompts)):
        start(prompt_index, 0)
    num_running = len(prompts)
    started = [False] * len(prompts)
    try:
        while num_running:
            prompt_index, index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if index == 0 and not started[prompt_index]:
                started[prompt_index] = True  # the prompt is cached (or sequence 0 failed)
                for other in range(1, num_sequences):
                    start(prompt_index, other)
                num_running += num_sequences - 1
            if item is None:
                num_running -= 1
                continue
            yield SequenceOutput(prompt_index, index, item)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def best_of(outputs: Sequence[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The finished sequences of one prompt that a request returns, in choice order: all of
    them for ``n``, the ``n`` likeliest for ``best_of``, with ``index`` set."""
    chosen = list(outputs)
    if params.num_sequences > params.n:
        chosen.sort(key=lambda o: o.cumulative_logprob or 0.0, reverse=True)
        chosen = chosen[: params.n]
        if params.logprobs is None:
            chosen = [
                dataclasses.replace(o, logprobs=None, new_logprobs=None, cumulative_logprob=None)
                for o in chosen
            ]
    for index, output in enumerate(chosen):
        output.index = index
    return chosen


async def generate_choices(
    backend: Backend,
    request_id: str,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    cache_salt: str | None = None,
) -> list[list[RequestOutput]]:
    """The final choices of each prompt (``best_of`` applied)."""
    finals: list[list[RequestOutput | None]] = [[None] * params.num_sequences for _ in prompts]
    stream = generate_sequences(backend, request_id, prompts, params, cache_salt)
    try:
        async for prompt_index, index, output in stream:
            finals[prompt_index][index] = output
    finally:
        await stream.aclose()
    for per_prompt in finals:
        if any(o is None or not o.finished for o in per_prompt):
            raise ReplicaFailedError("a sequence's outputs ended before it finished")
    return [best_of(per_prompt, params) for per_prompt in finals]
