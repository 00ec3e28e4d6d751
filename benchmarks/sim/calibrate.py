"""``python -m benchmarks calibrate``: fit a hardware profile to the real engine on this machine.

Measures the in-process engine (``cluster.LLM``, built-in ``tiny`` model, one replica) and fits
the cost model's constants (``cost_model.py``) by least squares:

* prefill: requests with ``max_tokens=1`` of n fresh tokens after a cached prefix of ctx tokens
  (ctx = 0: cold), timed alone; each sample is one step's fixed cost plus the prefill terms;
* decode: d running requests of context c, the time of one pure decode step;
* loads: a prompt of K blocks served from the host tier (NPU reset) minus the same prompt
  served from the NPU tier: K blocks of host -> NPU copies plus a fixed latency. Stores are
  taken to run at the same bandwidth (on CPU both are memory copies) and are synchronous.

One fit over all prefill and decode samples shares the step's fixed cost; a coefficient that
comes out negative is dropped (set to 0) and the rest refitted, the per-token prefill cost last
(``replicas.calibration.fit_step_costs``). Medians of repeated samples,
on one torch thread.
"""

import argparse
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.sim.cost_model import HardwareProfile
from cluster import LLM, KVOffloadConfig, SamplingParams, SchedulerConfig
from replicas.calibration import decode_step_times, fit_step_costs

BLOCK_SIZE = 16
FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)
PREFILL_LENGTHS = (64, 256, 512, 1024, 2048)
CACHED = ((512, 16), (512, 256), (2048, 16), (2048, 256))  # (cached prefix, new tokens)
DECODE = ((1, 64), (1, 512), (4, 64), (4, 512), (16, 64), (16, 512))  # (requests, context)
LOAD_BLOCKS = (32, 128, 256)
REPEATS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, required=True, help="profile JSON to write")
    parser.add_argument("--name", default="cpu-tiny", help="profile name (default cpu-tiny)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _llm(offload: KVOffloadConfig | None = None) -> LLM:
    config = SchedulerConfig(kv_offload_config=offload or KVOffloadConfig())
    llm = LLM(
        "tiny",
        block_size=BLOCK_SIZE,
        num_npu_blocks=2048,
        max_model_len=8192,
        scheduler_config=config,
    )
    rng = random.Random(-1)
    for _ in range(3):
        llm.generate(_tokens(rng, 300), FIRST_TOKEN)
    llm.reset_prefix_cache("all")
    return llm


def _ttft(llm: LLM, prompt: list[int]) -> float:
    output = llm.generate(prompt, FIRST_TOKEN)
    return output.first_token_time - output.arrival_time


def prefill_samples(llm: LLM, rng: random.Random) -> list[tuple[int, int, float]]:
    """(new tokens, cached context, seconds)."""
    samples = []
    for n in PREFILL_LENGTHS:
        times = [_ttft(llm, _tokens(rng, n)) for _ in range(REPEATS)]
        samples.append((n, 0, statistics.median(times)))
    for context, n in CACHED:
        times = []
        for _ in range(REPEATS):
            prefix = _tokens(rng, context)
            llm.generate(prefix + _tokens(rng, BLOCK_SIZE), FIRST_TOKEN)  # caches the prefix
            times.append(_ttft(llm, prefix + _tokens(rng, n)))
        samples.append((n, context, statistics.median(times)))
    return samples


def decode_samples(llm: LLM, rng: random.Random) -> list[tuple[int, int, float]]:
    """(running requests, their total context, seconds of one decode step)."""
    samples = []
    for num_seqs, context in DECODE:
        prompts = [_tokens(rng, context) for _ in range(num_seqs)]
        measured = decode_step_times(llm.engine, prompts, REPEATS, f"decode-{num_seqs}-{context}")
        context_total = round(statistics.mean(c for c, _ in measured))
        samples.append((num_seqs, context_total, statistics.median(t for _, t in measured)))
    return samples


def load_samples(rng: random.Random) -> list[tuple[int, float]]:
    """(blocks loaded from host, seconds): host-hit TTFT minus NPU-hit TTFT of one prompt."""
    offload = KVOffloadConfig(
        enabled=True, host_memory_ratio=2.0, write_through_threshold="immediate"
    )
    llm = _llm(offload)
    samples = []
    for num_blocks in LOAD_BLOCKS:
        deltas = []
        for _ in range(REPEATS):
            prefix = _tokens(rng, num_blocks * BLOCK_SIZE)
            llm.generate(prefix + _tokens(rng, 8), FIRST_TOKEN)  # stored to host at write
            llm.engine.step()  # let the stores land
            llm.reset_prefix_cache("npu")
            host = _ttft(llm, prefix + _tokens(rng, 8))
            npu = _ttft(llm, prefix + _tokens(rng, 8))
            deltas.append(host - npu)
        samples.append((num_blocks, statistics.median(deltas)))
    llm.shutdown()
    return samples


PROFILE_NAMES = {
    "step_s": "step_fixed_s",
    "prefill_s_per_token": "prefill_per_token_s",
    "prefill_s_per_token_context": "prefill_per_token_context_s",
    "decode_s_per_seq": "decode_per_seq_s",
    "decode_s_per_context_token": "decode_per_context_token_s",
}


def fit_compute(prefill: list, decode: list) -> tuple[dict[str, float], float]:
    """The replicas' least-squares step fit (``replicas.calibration.fit_step_costs``) over every
    step sample, under the profile's names; returns the constants and the median relative
    error of the fit."""
    fitted, error = fit_step_costs(prefill, decode)
    return {PROFILE_NAMES[k]: v for k, v in fitted.items()}, error


def fit_loads(samples: list[tuple[int, float]], block_bytes: int) -> tuple[float, float]:
    """(latency seconds, bytes per second) of host -> NPU loads."""
    blocks = np.asarray([s[0] for s in samples], dtype=float)
    seconds = np.asarray([s[1] for s in samples])
    slope, intercept = np.polyfit(blocks, seconds, 1)
    slope = max(slope, 1e-12)
    return max(float(intercept), 0.0), block_bytes / float(slope)


def calibrate(name: str) -> HardwareProfile:
    rng = random.Random(0)
    start = time.perf_counter()
    llm = _llm()
    specs = llm.engine.loaded.model.kv_cache_specs(torch.float32)
    kv_bytes_per_token = sum(spec.block_bytes(BLOCK_SIZE) for spec in specs.values()) // BLOCK_SIZE
    prefill = prefill_samples(llm, rng)
    decode = decode_samples(llm, rng)
    llm.shutdown()
    loads = load_samples(rng)
    compute, error = fit_compute(prefill, decode)
    latency, bandwidth = fit_loads(loads, kv_bytes_per_token * BLOCK_SIZE)
    return HardwareProfile(
        name=name,
        kv_bytes_per_token=kv_bytes_per_token,
        dtype="float32",
        kv_head_dim=next(iter(specs.values())).head_dim,
        npu_kv_memory_bytes=256 * 2**20,  # the tiny pool on a CPU: 4 contexts (kv/sizing.py)
        max_model_len=16384,  # the tiny model's max_position_embeddings
        **compute,
        h2d_bytes_per_s=bandwidth,
        d2h_bytes_per_s=bandwidth,
        transfer_latency_s=latency,
        stores_overlap_compute=False,
        description="The built-in tiny model (4 layers, fp32) on this machine's CPU, one "
        "in-process engine; fitted by `python -m benchmarks calibrate`.",
        sources={"all": "measured by benchmarks/sim/calibrate.py on the machine in `fit`"},
        fit={
            "median_relative_error": error,
            "prefill_samples": [list(s) for s in prefill],
            "decode_samples": [list(s) for s in decode],
            "load_samples": [list(s) for s in loads],
            "torch_num_threads": torch.get_num_threads(),
            "seconds": time.perf_counter() - start,
        },
    )


def run(args: argparse.Namespace) -> HardwareProfile:
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        profile = calibrate(args.name)
    finally:
        torch.set_num_threads(previous)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(profile.to_json())
    fitted = {k: v for k, v in asdict(profile).items() if isinstance(v, float)}
    print("\n".join(f"{k:30} {v:.4g}" for k, v in fitted.items()))
    print(f"median relative error {profile.fit['median_relative_error']:.3f}; wrote {args.output}")
    return profile
