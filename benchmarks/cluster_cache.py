"""cluster-cache: TTFT of a prefix pulled from another replica (the peer tier, through Ray) vs
computed again, on a Ray deployment of two replicas on this machine.

Round-robin routing sends consecutive requests to alternate replicas. Per prefix length and
repetition, three requests share a fresh random prefix and differ in their last block:
``cold`` (no replica holds the prefix: computed), ``pulled`` (on the other replica, which the
router tells to pull the prefix from the first one: ``replicas.kv.tiers.peer``) and ``local``
(back on the first replica, whose NPU tier holds it). TTFT is the time from the request to its
first token as the client sees it; the report gives medians and the pulled / cold ratio.

Fan-out (full runs): one replica computes a fresh ``fanout_prefix``-token prefix, then
``fanout_branches`` requests sharing it (each with a ``fanout_tail``-token tail of its own,
decoding ``fanout_max_tokens`` tokens) arrive together, routed
by the default scoring policy: today's routing (``peer_pull_min_blocks: 0``: a branch sent to
the replica without the prefix computes it) against pulling (that replica pulls the prefix
from the holder, once for all its branches). Each mode runs on its own deployment; the report
gives the branches' p50 and p90 TTFT.

Saturation (full runs): ``saturation_clients`` clients in a closed loop send
``saturation_requests`` requests, each one of ``saturation_prefixes`` shared prefixes (drawn
with popularity 1/rank) and a tail of its own, to a deployment whose replicas' NPU tiers hold
``saturation_npu_prefixes`` prefixes each (host as much), so that neither holds the whole pool:
today's routing against pulling, each on its own deployment; the report gives requests/s.
"""

import asyncio
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from benchmarks.report import Report, new_figure
from benchmarks.workload import BLOCK_SIZE, DEFAULT_MODEL, median, model_context_len, percentile
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
    fanout_prefix: int = 2048
    fanout_branches: int = 16
    fanout_tail: int = 512  # each branch's own prompt after the prefix: its own prefill work
    fanout_max_tokens: int = 32  # each branch decodes: the holder is busy while they run
    fanout_repeats: int = 3
    saturation_prefixes: int = 6  # the pool of shared prefixes, popularity 1/rank
    saturation_prefix: int = 1536
    saturation_tail: int = 64
    saturation_max_tokens: int = 16
    saturation_requests: int = 60
    saturation_clients: int = 6  # closed loop: each sends its next request when one ends
    saturation_npu_prefixes: float = 2.5  # each replica's NPU tier, in prefixes; host as much


QUICK = Settings(prefix_lens=(256,), repeats=1, fanout_repeats=0, saturation_requests=0)
FANOUT_MODES = {"today": 0, "pull": None}
"""``routing.peer_pull_min_blocks`` of each fan-out mode (None: the default)."""


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = DEFAULT_MODEL
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    limit = model_context_len(model) - 2 * BLOCK_SIZE
    lens = tuple(n for n in settings.prefix_lens if n <= limit) or (limit // BLOCK_SIZE * 16,)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    fanout_prefix = min(settings.fanout_prefix, limit - settings.fanout_tail)
    try:
        backend = RayBackend(_config(model, max(lens)), name="bench-cluster-cache")
        try:
            samples = asyncio.run(_measure(backend, lens, settings))
        finally:
            backend.shutdown()
        fanout = {}
        for mode, min_blocks in FANOUT_MODES.items() if settings.fanout_repeats else ():
            routing = {"policy": "scoring"}
            if min_blocks is not None:
                routing["peer_pull_min_blocks"] = min_blocks
            config = _config(model, fanout_prefix + settings.fanout_tail, routing)
            backend = RayBackend(config, name=f"bench-fanout-{mode}")
            try:
                fanout[mode] = asyncio.run(_fan_out(backend, fanout_prefix, settings))
            finally:
                backend.shutdown()
        saturation = _run_saturation(model, settings)
    finally:
        if started:
            ray.shutdown()
    report = _report(samples, settings, lens, model, command, quick)
    _add_fanout(report, fanout, fanout_prefix, settings)
    _add_saturation(report, saturation, settings)
    return report.write(output_dir)


def _config(model: str, max_prefix: int, routing: dict | None = None) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            "model": {"model": model, "max_model_len": max_prefix + 4 * BLOCK_SIZE},
            "routing": routing or {"policy": "round-robin"},
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


async def _fan_out(backend: RayBackend, length: int, settings: Settings) -> dict:
    """Per burst: each branch's TTFT (s), replica and cached tokens."""
    rng = random.Random(1)
    params = SamplingParams(max_tokens=settings.fanout_max_tokens, ignore_eos=True)
    vocab = backend.tokenizer.vocab_size
    samples: dict = {"ttft_s": [], "cached": [], "replica": [], "holder": []}
    for rep in range(settings.fanout_repeats):
        prefix = [rng.randrange(3, vocab) for _ in range(length)]
        tails = [[rng.randrange(3, vocab) for _ in range(settings.fanout_tail)] for _ in range(17)]
        _, held = await _timed(backend, f"hold-{rep}", prefix + tails[-1], params)
        samples["holder"].append(held.replica_index)
        await asyncio.sleep(settings.events_s)
        branches = await asyncio.gather(
            *(
                _timed(backend, f"branch-{rep}-{i}", prefix + tails[i % 16], params)
                for i in range(settings.fanout_branches)
            )
        )
        for ttft, output in branches:
            samples["ttft_s"].append(ttft)
            samples["cached"].append(output.num_cached_tokens)
            samples["replica"].append(output.replica_index)
    return samples


def _add_fanout(report: Report, fanout: dict, length: int, settings: Settings) -> None:
    if not fanout:
        return
    rows, summary = [], {}
    for mode, samples in fanout.items():
        ttfts = samples["ttft_s"]
        p50, p90 = percentile(ttfts, 50), percentile(ttfts, 90)
        summary[mode] = {"p50_ttft_s": p50, "p90_ttft_s": p90}
        away = sum(r != h for r, h in zip(samples["replica"], _holders(samples, settings)))
        rows.append([mode, 1e3 * p50, 1e3 * p90, away, min(samples["cached"])])
    if {"today", "pull"} <= summary.keys():
        summary["p90_pull_over_today"] = (
            summary["pull"]["p90_ttft_s"] / summary["today"]["p90_ttft_s"]
        )
    report.add_table(
        f"Fan-out: {settings.fanout_repeats} bursts of {settings.fanout_branches} branches "
        f"sharing a {length}-token prefix one replica holds (TTFT ms)",
        ["mode", "p50", "p90", "branches sent away from the holder", "fewest cached tokens"],
        rows,
    )
    report.results["fanout"] = {"prefix": length, "summary": summary, "samples": fanout}


def _run_saturation(model: str, settings: Settings) -> dict:
    """Per mode (today's routing, pulling), on a deployment of its own: requests/s and TTFTs
    of a closed loop over a pool of shared prefixes."""
    results = {}
    for mode, min_blocks in FANOUT_MODES.items() if settings.saturation_requests else ():
        routing = {"policy": "scoring"}
        if min_blocks is not None:
            routing["peer_pull_min_blocks"] = min_blocks
        config = _config(model, settings.saturation_prefix + settings.saturation_tail, routing)
        blocks = int(settings.saturation_npu_prefixes * settings.saturation_prefix / BLOCK_SIZE)
        model_config = config.model.model_copy(update={"num_npu_blocks": blocks})
        config = config.model_copy(update={"model": model_config})
        backend = RayBackend(config, name=f"bench-saturation-{mode}")
        try:
            results[mode] = asyncio.run(_saturation(backend, settings))
        finally:
            backend.shutdown()
    return results


async def _saturation(backend: RayBackend, settings: Settings) -> dict:
    """A closed loop of ``saturation_clients`` clients over ``saturation_requests`` requests,
    each a prefix of the pool (drawn with popularity 1/rank) and a tail of its own."""
    rng = random.Random(2)
    params = SamplingParams(max_tokens=settings.saturation_max_tokens, ignore_eos=True)
    vocab = backend.tokenizer.vocab_size
    pool = [
        [rng.randrange(3, vocab) for _ in range(settings.saturation_prefix)]
        for _ in range(settings.saturation_prefixes)
    ]
    weights = [1 / (rank + 1) for rank in range(len(pool))]
    prompts = [
        rng.choices(pool, weights)[0]
        + [rng.randrange(3, vocab) for _ in range(settings.saturation_tail)]
        for _ in range(settings.saturation_requests)
    ]
    queue = list(enumerate(prompts))
    samples: dict = {"ttft_s": [], "cached": [], "replica": []}

    async def client() -> None:
        while queue:
            i, prompt = queue.pop(0)
            ttft, output = await _timed(backend, f"sat-{i}", prompt, params)
            samples["ttft_s"].append(ttft)
            samples["cached"].append(output.num_cached_tokens)
            samples["replica"].append(output.replica_index)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(settings.saturation_clients)))
    samples["seconds"] = time.perf_counter() - start
    samples["requests_per_s"] = len(prompts) / samples["seconds"]
    stats = await backend.stats()
    samples["peer_blocks_loaded"] = [r.engine.cache.peer_blocks_loaded for r in stats.replicas]
    return samples


def _add_saturation(report: Report, saturation: dict, settings: Settings) -> None:
    if not saturation:
        return
    rows, summary = [], {}
    for mode, samples in saturation.items():
        tokens = settings.saturation_requests * (
            settings.saturation_prefix + settings.saturation_tail
        )
        cached = sum(samples["cached"]) / tokens
        ttfts = samples["ttft_s"]
        summary[mode] = {"requests_per_s": samples["requests_per_s"], "cached_share": cached}
        rows.append(
            [
                mode,
                samples["requests_per_s"],
                1e3 * percentile(ttfts, 50),
                1e3 * percentile(ttfts, 90),
                cached,
                sum(samples["peer_blocks_loaded"]),
            ]
        )
    if {"today", "pull"} <= summary.keys():
        summary["requests_per_s_pull_over_today"] = (
            summary["pull"]["requests_per_s"] / summary["today"]["requests_per_s"]
        )
    report.add_table(
        f"Saturation: {settings.saturation_clients} clients in a closed loop, "
        f"{settings.saturation_requests} requests over {settings.saturation_prefixes} shared "
        f"{settings.saturation_prefix}-token prefixes (popularity 1/rank), each replica's NPU "
        f"tier {settings.saturation_npu_prefixes:g} prefixes",
        ["mode", "requests/s", "p50 TTFT ms", "p90 TTFT ms", "cached share", "blocks pulled"],
        rows,
    )
    report.results["saturation"] = {"summary": summary, "samples": saturation}


def _holders(samples: dict, settings: Settings) -> list[int]:
    """Each branch's burst's holder, in the order of ``samples["replica"]``."""
    return [h for h in samples["holder"] for _ in range(settings.fanout_branches)]


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
