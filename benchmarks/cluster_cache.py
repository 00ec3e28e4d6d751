"""cluster-cache: TTFT of a prefix pulled from another replica (the peer tier, through Ray) vs
computed again, on a Ray deployment of two replicas on this machine.

Round-robin routing sends consecutive requests to alternate replicas. Per prefix length and
repetition, three requests share a fresh random prefix and differ in their last block:
``cold`` (no replica holds the prefix: computed), ``pulled`` (on the other replica, which the
router tells to pull the prefix from the first one: ``replicas.kv.tiers.peer``) and ``local``
(back on the first replica, whose NPU tier holds it). TTFT is the time from the request to its
first token as the client sees it; the report gives medians and the pulled / cold ratio.
"""

import asyncio
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from benchmarks.report import Report, new_figure
from benchmarks.workload import BLOCK_SIZE, DEFAULT_MODEL, median, model_context_len
from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from replicas.sampling_params import SamplingParams

NAME = "cluster-cache"
KINDS = ("cold", "pulled", "local")


@dataclass(frozen=True, slots=True)
class Settings:
    prefix_lens: tuple[int, ...] = (1024, 2048, 4096)
    repeats: int = 3
    max_tokens: int = 1
    events_s: float = 0.3  # the first replica's KV events reach the router


QUICK = Settings(prefix_lens=(256,), repeats=1)


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = DEFAULT_MODEL
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    limit = model_context_len(model) - 2 * BLOCK_SIZE
    lens = tuple(n for n in settings.prefix_lens if n <= limit) or (limit // BLOCK_SIZE * 16,)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    backend = RayBackend(_config(model, max(lens)), name="bench-cluster-cache")
    try:
        samples = asyncio.run(_measure(backend, lens, settings))
    finally:
        backend.shutdown()
        if started:
            ray.shutdown()
    return _report(samples, settings, lens, model, command, quick).write(output_dir)


def _config(model: str, max_prefix: int) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            "model": {"model": model, "max_model_len": max_prefix + 4 * BLOCK_SIZE},
            "routing": {"policy": "round-robin"},
            "scheduler": {
                "kv_offload_config": {
                    "enabled": True,
                    "host_memory_ratio": 1.0,
                    "tiers": {"peer": {}},
                }
            },
            "ray": {"cpus_per_replica": 1.0},
        }
    )


async def _measure(backend: RayBackend, lens: tuple[int, ...], settings: Settings) -> dict:
    """Per prefix length and kind, the TTFTs (s) and the tokens each request found cached."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=settings.max_tokens, ignore_eos=True)
    vocab = backend.tokenizer.vocab_size
    samples: dict = {}
    for length in lens:
        for kind in KINDS:
            samples[f"{length}/{kind}"] = {"ttft_s": [], "cached": [], "replica": []}
        for rep in range(settings.repeats):
            prefix = [rng.randrange(3, vocab) for _ in range(length)]
            for i, kind in enumerate(KINDS):
                tail = [rng.randrange(3, vocab) for _ in range(BLOCK_SIZE)]
                ttft, output = await _timed(
                    backend, f"{length}-{rep}-{kind}", prefix + tail, params
                )
                entry = samples[f"{length}/{kind}"]
                entry["ttft_s"].append(ttft)
                entry["cached"].append(output.num_cached_tokens)
                entry["replica"].append(output.replica_index)
                if i < len(KINDS) - 1:
                    await asyncio.sleep(settings.events_s)
            # round-robin: the next repetition's cold request goes to the other replica
    return samples


async def _timed(backend: RayBackend, request_id: str, prompt: list[int], params):
    start = time.perf_counter()
    first = None
    final = None
    async for output in backend.generate(request_id, prompt, params):
        if first is None and output.token_ids:
            first = time.perf_counter() - start
        final = output
    return first, final


def _report(samples, settings, lens, model, command, quick) -> Report:
    report = Report(
        NAME,
        f"Pulled from a peer vs recomputed: TTFT on two replicas, model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    rows, medians = [], {}
    for length in lens:
        cold, pulled, local = (median(samples[f"{length}/{k}"]["ttft_s"]) for k in KINDS)
        medians[length] = {"cold": cold, "pulled": pulled, "local": local}
        cached = [min(samples[f"{length}/{k}"]["cached"]) for k in KINDS]
        rows.append([length, 1e3 * cold, 1e3 * pulled, 1e3 * local, pulled / cold, *cached])
    report.add_table(
        f"Median TTFT over {settings.repeats} repetitions (ms), and the fewest tokens each kind "
        "found cached",
        ["prefix", "cold", "pulled", "local", "pulled / cold", "cached cold", "pulled", "local"],
        rows,
    )
    figure, (axis,) = new_figure()
    for kind, marker in zip(KINDS, "osD"):
        axis.plot(lens, [1e3 * medians[n][kind] for n in lens], marker=marker, label=kind)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("prefix tokens")
    axis.set_ylabel("median TTFT (ms, log)")
    axis.set_title("pulled from a peer vs computed vs local")
    axis.legend()
    report.figures["ttft.png"] = figure
    report.results = {"settings": asdict(settings), "median_ttft_s": medians, "samples": samples}
    return report
