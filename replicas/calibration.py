"""A replica's step costs, measured on its own engine: what the router's ``ttft`` profile
predicts a time to first token from (``router.config.TTFTCosts``) when the config gives none.
The record the replica reports, ``StepCosts``, lives in ``replicas.step_costs`` (the router
imports it without torch or the engine).

``measure_step_costs`` times engine steps on random prompts, before the replica serves:

* prefill: one request of n fresh tokens (cold), and of n tokens after a cached prefix (the
  request that cached the prefix is a cold sample too);
* decode: d running requests of context c, the time of one pure decode step;
* reload: one fused host -> NPU copy of a few blocks' KV (the KV transfer's copy), per block;
  with a disk tier, the disk store's measured read time per block is added for disk blocks.

``fit_step_costs`` fits the step model by least squares over every sample, sharing the step's
fixed cost (``benchmarks/sim/cost_model.py`` has the same shape)::

    prefill step = step_s + prefill_s_per_token x n + prefill_s_per_token_context x n (ctx + n/2)
    decode step  = step_s + decode_s_per_seq x d + decode_s_per_context_token x (sum of contexts)

A coefficient that comes out negative is dropped (set to 0) and the rest refitted; the per-token
prefill cost is never dropped (the fixed cost and the context term give way to it). Each point
is the fastest of its repeats (the one least disturbed by other processes). The blocks the
samples cached are forgotten afterwards (NPU and host), and the engine's counters zeroed.
"""

import logging
import random
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from replicas.kv.events import Tier
from replicas.sampling_params import SamplingParams
from replicas.step_costs import StepCosts

if TYPE_CHECKING:
    from replicas.engine.engine import Engine

logger = logging.getLogger(__name__)

PREFILL_BLOCKS = (2, 8)
"""Cold prefill lengths, in blocks (capped by the step's token budget and the context)."""
CACHED_BLOCKS = ((16, 2),)
"""(cached prefix, new tokens) in blocks; caching the prefix is a cold sample of its own."""
DECODE = ((1, 4), (4, 8))
"""(running requests, context of each in blocks)."""
RELOAD_BLOCKS = 16
REPEATS = 2

FIT_NAMES = (
    "step_s",
    "prefill_s_per_token",
    "prefill_s_per_token_context",
    "decode_s_per_seq",
    "decode_s_per_context_token",
)
STEP, PER_TOKEN, CONTEXT = 0, 1, 2  # their columns in the fit


def fit_step_costs(
    prefill: Sequence[tuple[int, int, float]], decode: Sequence[tuple[int, int, float]]
) -> tuple[dict[str, float], float]:
    """Least squares over ``(new tokens, cached context, seconds)`` prefill samples and
    ``(running requests, their total context, seconds)`` decode samples: the ``FIT_NAMES``
    constants and the fit's median relative error."""
    rows, times = [], []
    for n, context, seconds in prefill:
        rows.append([1.0, n, n * (context + n / 2), 0.0, 0.0])
        times.append(seconds)
    for num_seqs, total_context, seconds in decode:
        rows.append([1.0, 0.0, 0.0, num_seqs, total_context])
        times.append(seconds)
    a, b = np.asarray(rows, dtype=float), np.asarray(times, dtype=float)
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        negative = {column: c for column, c in zip(keep, coef) if c < 0}
        if not negative:
            break
        # The per-token prefill cost is what a TTFT prediction needs most: the other terms give
        # way first, then those a noisy fit lets absorb it (the fixed cost, the context term),
        # until it is fitted through the origin on the prefill samples alone (positive).
        others = {column: c for column, c in negative.items() if column != PER_TOKEN}
        if others:
            keep.remove(min(others, key=others.__getitem__))
        else:
            keep.remove(next(c for c in (STEP, CONTEXT) if c in keep))
    full = np.zeros(a.shape[1])
    full[keep] = coef
    relative = np.abs(a @ full - b) / np.maximum(b, 1e-12)
    return dict(zip(FIT_NAMES, map(float, full))), float(np.median(relative))


def measure_step_costs(engine: "Engine", seed: int = 0) -> StepCosts:
    """Time ``engine``'s steps on random prompts and fit ``StepCosts``. The engine must be idle;
    it is idle again afterwards, with the blocks the samples cached forgotten."""
    if engine.has_unfinished_requests():
        raise RuntimeError("measure_step_costs needs an idle engine")
    start = time.perf_counter()
    sampler = _Sampler(engine, random.Random(seed))
    sampler.prefill([8])  # warm-up: first calls pay for allocations and kernel selection
    prefill = sampler.prefill_samples()
    decode = sampler.decode_samples()
    engine.reset_prefix_cache("npu")
    if engine.transfer is not None:
        engine.reset_prefix_cache("host")
    engine.reset_counters()
    fitted, error = fit_step_costs(prefill, decode)
    reload = _reload_s_per_block(engine)
    disk = 0.0
    disk_stores = engine.backing.get(Tier.DISK, {}).values()
    if disk_stores:
        disk = reload + max(store.read_seconds_per_block() for store in disk_stores)
    costs = StepCosts(
        **fitted,
        reload_s_per_block=reload,
        disk_reload_s_per_block=disk,
        max_num_batched_tokens=engine.config.scheduler_config.max_num_batched_tokens,
        fit_error=error,
        seconds=time.perf_counter() - start,
    )
    logger.info(
        "measured step costs in %.2f s (fit error %.1f%%): %s",
        costs.seconds,
        100 * error,
        ", ".join(f"{k} {v:.3g}" for k, v in costs.ttft_costs().items()),
    )
    return costs


class _Sampler:
    def __init__(self, engine: "Engine", rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.block_size = engine.block_size
        sched = engine.config.scheduler_config
        # One step computes a sample's prompt: it fits the step's budget and the context.
        self.max_tokens = min(sched.max_num_batched_tokens, engine.max_model_len - 1)
        self.vocab_size = engine.loaded.args.vocab_size
        self._next_id = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int = 1):
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return self.engine.add_request(f"calibration-{self._next_id}", prompt, params)

    def prefill(self, prompt: list[int]) -> tuple[int, int, float]:
        """``(tokens computed, cached context, seconds of the steps to its first token)``."""
        request = self._add(prompt)
        seconds = 0.0
        while not request.is_finished:
            begin = time.perf_counter()
            self.engine.step()
            seconds += time.perf_counter() - begin
        cached = request.num_cached_tokens or 0
        return len(prompt) - cached, cached, seconds

    def prefill_samples(self) -> list[tuple[int, int, float]]:
        """The fastest run per (new tokens, cached context) point."""
        runs: dict[tuple[int, int], list[float]] = {}

        def add(sample: tuple[int, int, float]) -> None:
            runs.setdefault(sample[:2], []).append(sample[2])

        lengths = sorted({min(b * self.block_size, self.max_tokens) for b in PREFILL_BLOCKS})
        for n in lengths:
            for _ in range(REPEATS):
                add(self.prefill(self._tokens(n)))
        for cached_blocks, new_blocks in CACHED_BLOCKS:
            context = cached_blocks * self.block_size
            n = new_blocks * self.block_size
            if context + n > self.engine.max_model_len - 1 or context + 1 > self.max_tokens:
                continue
            for _ in range(REPEATS):
                prefix = self._tokens(context)
                add(self.prefill(prefix + self._tokens(1)))  # caches the prefix's full blocks
                add(self.prefill(prefix + self._tokens(n)))
        return [(n, ctx, min(times)) for (n, ctx), times in runs.items()]

    def decode_samples(self) -> list[tuple[int, int, float]]:
        samples = []
        for num_seqs, context_blocks in DECODE:
            context = max(1, min(context_blocks * self.block_size, self.engine.max_model_len - 8))
            prompts = [self._tokens(context) for _ in range(num_seqs)]
            self._next_id += 1
            name = f"calibration-{self._next_id}"
            measured = decode_step_times(self.engine, prompts, REPEATS, name)
            total_context = round(statistics.mean(c for c, _ in measured))
            samples.append((num_seqs, total_context, min(t for _, t in measured)))
        return samples


def decode_step_times(
    engine: "Engine", prompts: Sequence[list[int]], num_steps: int, id_prefix: str
) -> list[tuple[int, float]]:
    """Run ``prompts`` together on the idle ``engine`` until each has its first token, then time
    ``num_steps`` pure decode steps: ``(total context of the running requests, seconds)`` per
    step. The requests run to their end."""
    params = SamplingParams(max_tokens=num_steps + 2, ignore_eos=True)
    requests = [engine.add_request(f"{id_prefix}-{i}", p, params) for i, p in enumerate(prompts)]
    while any(r.first_token_time is None for r in requests):
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        total = sum(r.num_tokens - 1 for r in requests if not r.is_finished)
        begin = time.perf_counter()
        engine.step()
        times.append((total, time.perf_counter() - begin))
    return times[:num_steps]


def _reload_s_per_block(engine: "Engine") -> float:
    """One fused host -> NPU copy of ``RELOAD_BLOCKS`` blocks of every cache type, per block
    (0 without a host tier: nothing is ever reloaded)."""
    if engine.transfer is None:
        return 0.0
    times = []
    pairs = []
    for kv in engine.runner.kv_caches.values():
        shape = (RELOAD_BLOCKS, *kv.shape[1:])
        pinned = kv.device.type == "cuda"
        pairs.append(
            (
                torch.empty(shape, dtype=kv.dtype, device=kv.device),
                torch.ones(shape, dtype=kv.dtype, pin_memory=pinned),
            )
        )
    for _ in range(REPEATS + 1):
        begin = time.perf_counter()
        for destination, source in pairs:
            destination.copy_(source, non_blocking=True)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        times.append(time.perf_counter() - begin)
    return min(times[1:]) / RELOAD_BLOCKS
