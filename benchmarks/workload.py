"""Pieces every engine scenario shares: building an engine, prompts, one timed request, stats.

The machine is small and shared, so no single timing means much. Scenarios interleave the
variants they compare (``rotated``), repeat, and report medians and ratios.
"""

import dataclasses
import random
import statistics
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.outputs import RequestOutput

T = TypeVar("T")

# One output token: the request's latency is its time to first token (prefill).
FIRST_TOKEN_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)
BLOCK_SIZE = 16


def random_tokens(rng: random.Random, num_tokens: int) -> list[int]:
    """Byte-tokenizer ids (< 256), so prompts are as long as asked."""
    return [rng.randrange(256) for _ in range(num_tokens)]


def build_llm(
    *,
    num_npu_blocks: int,
    max_model_len: int,
    prefix_caching: bool = True,
    offload: KVOffloadConfig | None = None,
) -> LLM:
    """The built-in ``tiny`` model with an explicit NPU pool, warmed up so that the first
    measured request pays no one-off costs (lazy initialisation in torch)."""
    scheduler_config = SchedulerConfig(
        prefix_cache_config=PrefixCacheConfig(enabled=prefix_caching),
        kv_offload_config=offload or KVOffloadConfig(),
    )
    llm = LLM(
        "tiny",
        seed=0,
        block_size=BLOCK_SIZE,
        num_npu_blocks=num_npu_blocks,
        max_model_len=max_model_len,
        scheduler_config=scheduler_config,
    )
    rng = random.Random(-1)
    for _ in range(2):
        llm.generate(random_tokens(rng, 4 * BLOCK_SIZE + 3), FIRST_TOKEN_ONLY)
    settle(llm)
    llm.reset_prefix_cache("all")
    return llm


def settle(llm: LLM) -> None:
    """Run one idle engine step, which lands any copy still in flight (on CUDA a store completes
    asynchronously; on CPU every copy has landed when its step returns), so that no measured
    request pays for an earlier one's copies.
    """
    if not llm.engine.has_unfinished_requests():
        llm.engine.step()


def timed_request(llm: LLM, prompt: list[int]) -> RequestOutput:
    """Run one prompt to its first (and only) token; the output carries ``ttft_s``."""
    output = llm.generate(prompt, FIRST_TOKEN_ONLY)
    if output.ttft_s is None:
        raise RuntimeError(f"request {output.request_id} finished without a first token")
    return output


def rotated(items: Sequence[T], index: int) -> list[T]:
    """``items`` starting at position ``index`` (mod length): interleaving with no fixed order,
    so no variant always runs first or right after another."""
    k = index % len(items)
    return [*items[k:], *items[:k]]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def cache_counters(llm: LLM) -> dict[str, int]:
    """A copy of the engine's integer cache counters (the engine mutates its own in place)."""
    stats = llm.stats().cache
    values = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    return {name: value for name, value in values.items() if isinstance(value, int)}


def counters_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: value - before.get(name, 0) for name, value in after.items()}
