"""routing: round-robin vs the scoring profiles on dp 2 with a multi-tenant shared-prefix load
(``--quick`` runs round-robin, balanced and ttft with reservations).

Tenants each own a long system prompt; every request is one tenant's prompt plus a short
unique question, with tenants drawn Zipf-skewed. Requests go through the real deployment (the
router actor and two replica actors on an embedded Ray, as ``strata serve`` runs them), a few at
a time. Each replica's NPU pool holds about half of the tenants' prompts, so where a request
lands decides whether its prefix is found. Reported per policy: prompt-token hit rate, TTFT
(client side: submit to first token), and how requests and load spread over the replicas.
"""

import asyncio
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from benchmarks.report import Report, new_figure
from benchmarks.workload import median, percentile, random_tokens
from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from replicas.sampling_params import SamplingParams

NAME = "routing"
RESERVED = {"prefix_cache_config": {"reservation_share": 0.2}}
POLICIES: dict[str, tuple[dict, dict]] = {  # name: (routing, scheduler overrides)
    "round-robin": ({"policy": "round-robin"}, {}),
    "balanced": ({"scoring_profile": "balanced"}, {}),
    "locality": ({"scoring_profile": "locality"}, {}),
    "load": ({"scoring_profile": "load"}, {}),
    # The ttft profile priced with the step costs the replicas measure at start-up.
    "ttft": ({"scoring_profile": "ttft"}, {}),
    "ttft-reserved": ({"scoring_profile": "ttft"}, RESERVED),
}
QUICK_POLICIES = ("round-robin", "balanced", "ttft-reserved")


@dataclass(frozen=True, slots=True)
class Settings:
    num_tenants: int = 8
    prefix_len: int = 512
    question_len: int = 24
    num_requests: int = 96
    concurrency: int = 10
    max_tokens: int = 8
    zipf_s: float = 0.8
    num_npu_blocks: int = 160  # per replica: about half of the tenants' prompts
    rounds: int = 3  # each a new workload (seed + round) served by every policy in turn
    seed: int = 0


QUICK = Settings(num_tenants=4, prefix_len=128, num_requests=16, num_npu_blocks=40, rounds=1)


def _prompts(settings: Settings, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, settings.prefix_len) for _ in range(settings.num_tenants)]
    weights = [1 / (k + 1) ** settings.zipf_s for k in range(settings.num_tenants)]
    tenants = rng.choices(range(settings.num_tenants), weights, k=settings.num_requests)
    return [prefixes[t] + random_tokens(rng, settings.question_len) for t in tenants]


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    names = QUICK_POLICIES if quick else tuple(POLICIES)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for round_index in range(settings.rounds):
            prompts = _prompts(settings, settings.seed + round_index)
            for name in names:
                runs[name].append(_run_policy(name, *POLICIES[name], settings, prompts))
    finally:
        if started_ray:
            ray.shutdown()
    results = {name: _pooled(r) for name, r in runs.items()}

    report = Report(
        NAME,
        "Routing policies on dp 2, multi-tenant shared prefixes",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        f"{settings.rounds} x {settings.num_requests} requests, {settings.num_tenants} tenants x "
        f"{settings.prefix_len}-token prompts, concurrency {settings.concurrency} (rounds "
        "pooled; throughput: mean of rounds)",
        [
            "policy",
            "hit rate",
            "mean TTFT (ms)",
            "p50 (ms)",
            "p99 (ms)",
            "requests/replica",
            "max/mean requests",
            "throughput (req/s)",
            "reservations (dropped)",
        ],
        [
            [
                name,
                r["hit_rate"],
                1e3 * r["ttft_mean_s"],
                1e3 * r["ttft_p50_s"],
                1e3 * r["ttft_p99_s"],
                " / ".join(map(str, r["requests_per_replica"])),
                r["request_imbalance"],
                r["throughput_rps"],
                f"{r['reservations']} ({r['reservations_dropped']})",
            ]
            for name, r in results.items()
        ],
    )
    best = max(results, key=lambda n: results[n]["hit_rate"])
    report.sections.append(
        f"Highest hit rate: **{best}**. Round-robin and `load` scatter each tenant over both "
        "replicas, so each replica's pool must hold every tenant's prompt and evicts; "
        "`locality` keeps tenants on one replica at the cost of balance; `balanced` trades "
        "between the two; `ttft` routes to the lowest time to first token predicted with the "
        "step costs each replica measured at start-up, and `ttft-reserved` also holds a "
        "waiting request's cached prefix (up to 20% of a replica's NPU blocks)."
    )
    figure, (left, right) = new_figure(2, width=11)
    names = list(results)
    left.bar(names, [results[n]["hit_rate"] for n in names])
    left.set_ylabel("prompt-token hit rate")
    for name in names:
        ttfts = sorted(results[name]["ttfts_s"])
        right.plot(
            [1e3 * t for t in ttfts], [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name
        )
    right.set_xscale("log")
    right.set_xlabel("TTFT (ms, log)")
    right.set_ylabel("fraction of requests")
    right.legend()
    report.figures["routing.png"] = figure
    report.results = {"settings": asdict(settings), "policies": results}
    return report.write(output_dir)


def _run_policy(
    name: str, routing: dict, scheduler: dict, settings: Settings, prompts: list[list[int]]
) -> dict:
    config = ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            "model": {
                "model": "tiny",
                "num_npu_blocks": settings.num_npu_blocks,
                "max_model_len": settings.num_npu_blocks * 16,
            },
            "scheduler": scheduler,
            "routing": routing,
            "ray": {"cpus_per_replica": 1.0},
        }
    )
    backend = RayBackend(config, name=f"bench-routing-{name}")
    try:
        return asyncio.run(_drive(backend, settings, prompts))
    finally:
        backend.shutdown()


async def _drive(backend: RayBackend, settings: Settings, prompts: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=settings.max_tokens, ignore_eos=True)
    slots = asyncio.Semaphore(settings.concurrency)
    ttfts: list[float] = []
    served = [0, 0]
    cached = prompt_tokens = 0

    async def one(i: int, prompt: list[int]) -> None:
        nonlocal cached, prompt_tokens
        async with slots:
            start = time.perf_counter()
            first = None
            async for output in backend.generate(f"r{i}", prompt, params):
                if first is None:
                    first = time.perf_counter() - start
                final = output
            ttfts.append(first)
            served[final.replica_index] += 1
            cached += final.num_cached_tokens
            prompt_tokens += len(prompt)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    for report in await backend.check_integrity():
        if report["npu_blocks_used"] or report["num_unfinished"]:
            raise RuntimeError(f"blocks left in use after the run: {report}")
    stats = await backend.stats()
    caches = [r.engine.cache for r in stats.replicas if r.engine is not None]
    return {
        "reservations": sum(c.reservations for c in caches),
        "reservations_dropped": sum(c.reservations_dropped for c in caches),
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "requests_per_replica": served,
        "throughput_rps": len(prompts) / elapsed,
        "ttfts_s": ttfts,
    }


def _pooled(runs: list[dict]) -> dict:
    """One policy's rounds together: every request's TTFT, hit rate over all prompt tokens."""
    ttfts = [t for r in runs for t in r["ttfts_s"]]
    served = [sum(counts) for counts in zip(*(r["requests_per_replica"] for r in runs))]
    return {
        "hit_rate": sum(r["cached_tokens"] for r in runs) / sum(r["prompt_tokens"] for r in runs),
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_p50_s": median(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        "requests_per_replica": served,
        "request_imbalance": max(served) / (sum(served) / len(served)),
        "throughput_rps": sum(r["throughput_rps"] for r in runs) / len(runs),
        "reservations": sum(r["reservations"] for r in runs),
        "reservations_dropped": sum(r["reservations_dropped"] for r in runs),
        "ttfts_s": ttfts,
        "rounds": [{k: v for k, v in r.items() if k != "ttfts_s"} for r in runs],
    }
