"""Pieces every engine scenario shares: building an engine, prompts, one timed request, stats.

The machine is small and shared, so no single timing means much. Scenarios interleave the
variants they compare (``rotated``), repeat, and report medians and ratios.
"""

import random
import statistics
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.kv.capacity import kv_cache_specs
from replicas.model import ByteTokenizer, load_model_info
from replicas.outputs import RequestOutput

T = TypeVar("T")

# One output token: the request's latency is its time to first token (prefill).
FIRST_TOKEN_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)
BLOCK_SIZE = 16
DEFAULT_MODEL = "tiny"  # what engine scenarios run unless given --model
BYTE_IDS = 256


def random_tokens(rng: random.Random, num_tokens: int, vocab_size: int = BYTE_IDS) -> list[int]:
    """Ids drawn uniformly below ``vocab_size``. The default, byte-tokenizer ids (< 256), makes
    prompts as long as asked with ``tiny``; for a real model pass ``prompt_vocab(llm)``: any
    valid id will do for timing."""
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def prompt_vocab(llm: LLM) -> int:
    """How many ids prompts for ``llm`` draw from: the bytes for the byte tokenizer, otherwise
    every id that both the tokenizer and the model's embedding table know."""
    if isinstance(llm.tokenizer, ByteTokenizer):
        return BYTE_IDS
    return min(llm.tokenizer.vocab_size, llm.engine.loaded.args.vocab_size)


def model_context_len(model: str) -> int:
    """The most positions ``model`` takes (its config only; no weights are loaded)."""
    args, _ = load_model_info(model)
    return args.max_position_embeddings


def kv_block_bytes(model: str, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """One KV block of every cache type of ``model`` computing in ``dtype`` with K and V stored
    in ``kv_cache_dtype``, scales included (its config only)."""
    args, _ = load_model_info(model)
    specs = kv_cache_specs(args, dtype, kv_cache_dtype)
    return sum(spec.block_bytes(BLOCK_SIZE) for spec in specs.values())


def fit_length(num_tokens: int, limit: int) -> int:
    """``num_tokens``, or the most whole blocks below ``limit`` if it does not fit."""
    return num_tokens if num_tokens <= limit else limit // BLOCK_SIZE * BLOCK_SIZE


def engine_options(
    scenario: str, device: str | None, dtypes: Sequence[str] | None
) -> dict[str, object]:
    """``build_llm``'s options for a scenario that runs its engines on ``device`` (None: the
    engine's ``auto``) with one weights dtype (``dtypes``: one, or None for the engine's)."""
    if dtypes is not None and len(dtypes) != 1:
        raise ValueError(f"{scenario} measures one dtype at a time, got {list(dtypes)}")
    options: dict[str, object] = {} if device is None else {"device": device}
    if dtypes is not None:
        options["dtype"] = dtypes[0]
    return options


def build_llm(
    *,
    num_npu_blocks: int,
    max_model_len: int,
    prefix_caching: bool = True,
    offload: KVOffloadConfig | None = None,
    model: str = DEFAULT_MODEL,
    speculative_ngram: int = 0,
    prefix_cache: PrefixCacheConfig | None = None,
    max_num_seqs: int | None = None,
    **engine_options: object,
) -> LLM:
    """``model`` (by default the built-in ``tiny``) with an explicit NPU pool, warmed up so that
    the first measured request pays no one-off costs (lazy initialisation in torch).
    ``prefix_cache`` replaces ``PrefixCacheConfig(enabled=prefix_caching)`` (e.g. with
    ``batch_tenants``); ``max_num_seqs``: the scheduler's (None: its default); ``engine_options``
    go to ``LLM`` (e.g. ``dtype``)."""
    limits = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    scheduler_config = SchedulerConfig(
        prefix_cache_config=prefix_cache or PrefixCacheConfig(enabled=prefix_caching),
        kv_offload_config=offload or KVOffloadConfig(),
        speculative_ngram=speculative_ngram,
        **limits,
    )
    llm = LLM(
        model,
        seed=0,
        block_size=BLOCK_SIZE,
        num_npu_blocks=num_npu_blocks,
        max_model_len=max_model_len,
        scheduler_config=scheduler_config,
        **engine_options,
    )
    rng = random.Random(-1)
    warmup_len = min(4 * BLOCK_SIZE + 3, max_model_len - 1)
    for _ in range(2):
        llm.generate(random_tokens(rng, warmup_len), FIRST_TOKEN_ONLY)
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


def timed_request(llm: LLM, prompt: list[int], cache_salt: str | None = None) -> RequestOutput:
    """Run one prompt (as tenant ``cache_salt``) to its first (and only) token; the output
    carries ``ttft_s`` and ``num_cached_tokens``."""
    output = llm.generate(prompt, FIRST_TOKEN_ONLY, cache_salt=cache_salt)
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
    return llm.stats().cache.counters()


def counters_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: value - before.get(name, 0) for name, value in after.items()}
