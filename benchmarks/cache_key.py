"""cache-key: ``prompt_cache_key`` affinity against no key, in the trace simulator.

Sessions each own a prefix that only their own requests share (an eighth of each prompt: a
short system prompt); the rest of every prompt is new. Sessions are drawn
Zipf-skewed and arrive as a Poisson process. Each request is replayed through the real
``Router`` and real ``EngineCore``s (``benchmarks/sim``, cost model ``h200-llama8b``, dp 4, no
host tier, 300 NPU blocks per replica against 28 new blocks per request) twice: with each
request's session as its ``prompt_cache_key``, and without a key. With the key, the router
keeps a session on its replica until the load rule says that replica is overloaded
(``routing.key_overload_factor``); without it, a session whose shared prefix is an eighth of its
prompt is pulled to the least loaded replica whenever the load term outweighs that eighth.
Keyed runs use the default ``key_overload_factor`` (2, the "key" row) and, in the full run,
1.25 and 3, which trade hit rate against TTFT p99. Reported: prompt-token hit rate, TTFT p50
and p99, and the load imbalance, each the mean over seeds.
"""

import dataclasses
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.report import Report, new_figure
from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.simulator import SimConfig, Simulator
from benchmarks.sim.trace import TRACE_TOKENS_PER_HASH_ID, TraceRecord, TraceRequest, expand
from router.config import DEFAULT_KEY_OVERLOAD_FACTOR

NAME = "cache-key"
HARDWARE = "h200-llama8b"


@dataclass(frozen=True, slots=True)
class Settings:
    num_sessions: int = 64
    prefix_blocks: int = 4  # hash ids (one KV block each) a session's requests share
    suffix_blocks: int = 28  # hash ids new to each request
    num_requests: int = 900
    requests_per_s: float = 2.0  # the replicas about 75% busy
    output_tokens: int = 256  # trace tokens
    zipf_s: float = 0.8
    data_parallel_size: int = 4
    num_npu_blocks: int = 300  # per replica (the sessions' prefixes: 256 blocks)
    seeds: tuple[int, ...] = (0, 1, 2)
    overload_factors: tuple[float, ...] = (1.25, 2.0, 3.0)  # the default 2 is the "key" row


QUICK = Settings(num_requests=300, seeds=(0,), overload_factors=(2.0,))


def _requests(settings: Settings, seed: int) -> list[TraceRequest]:
    """The workload of one seed: each record's hash ids are its session's prefix, then ids no
    other record has; each request carries its session as its key."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** settings.zipf_s for k in range(settings.num_sessions)]
    sessions = rng.choices(range(settings.num_sessions), weights, k=settings.num_requests)
    fresh = settings.num_sessions * settings.prefix_blocks  # first id of the unique ones
    records, now_ms = [], 0.0
    for index, session in enumerate(sessions):
        now_ms += 1000.0 * rng.expovariate(settings.requests_per_s)
        start = session * settings.prefix_blocks
        prefix = range(start, start + settings.prefix_blocks)
        first = fresh + index * settings.suffix_blocks
        suffix = range(first, first + settings.suffix_blocks)
        num_blocks = settings.prefix_blocks + settings.suffix_blocks
        records.append(
            TraceRecord(
                now_ms,
                num_blocks * TRACE_TOKENS_PER_HASH_ID,
                settings.output_tokens,
                (*prefix, *suffix),
            )
        )
    requests = expand(records, SimConfig().tokens_per_hash_id)
    return [
        dataclasses.replace(request, cache_key=f"session-{session}")
        for request, session in zip(requests, sessions)
    ]


def _simulate(
    settings: Settings, requests: list[TraceRequest], overload_factor: float | None
) -> dict:
    """One run: keyed with that ``key_overload_factor``, or without keys (None)."""
    config = SimConfig(
        data_parallel_size=settings.data_parallel_size,
        num_npu_blocks=settings.num_npu_blocks,
        key_overload_factor=overload_factor or DEFAULT_KEY_OVERLOAD_FACTOR,
    )
    if overload_factor is None:
        requests = [dataclasses.replace(r, cache_key=None) for r in requests]
    cost_model = CostModel(HardwareProfile.load(HARDWARE), config.block_size, config.token_scale)
    return Simulator(config, cost_model, requests).run()


def _pooled(records: list[dict]) -> dict:
    def mean(field: str) -> float:
        return sum(float(r[field]) for r in records) / len(records)

    return {
        "hit_rate": mean("hit_rate"),
        "ttft_p50_s": mean("ttft_p50_s"),
        "ttft_p99_s": mean("ttft_p99_s"),
        "load_imbalance": mean("load_imbalance"),
        "best_replica_match": mean("best_replica_match"),
        "runs": [
            {k: r[k] for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "load_imbalance")}
            for r in records
        ],
    }


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    variants: dict[str, float | None] = {"no key": None}
    for factor in settings.overload_factors:
        name = "key" if factor == DEFAULT_KEY_OVERLOAD_FACTOR else f"key, factor {factor:g}"
        variants[name] = factor
    records: dict[str, list[dict]] = {name: [] for name in variants}
    for seed in settings.seeds:
        requests = _requests(settings, seed)
        for name, factor in variants.items():
            records[name].append(_simulate(settings, requests, factor))
    results = {name: _pooled(r) for name, r in records.items()}
    report = Report(
        NAME, "prompt_cache_key affinity vs no key", command, quick, __doc__.split("\n\n", 1)[1]
    )
    report.add_table(
        f"dp {settings.data_parallel_size}, {settings.num_sessions} sessions, "
        f"{settings.num_requests} requests per seed, mean over {len(settings.seeds)} seed(s)",
        ["routing", "hit rate", "TTFT p50 (s)", "TTFT p99 (s)", "load imbalance"],
        [
            [name, r["hit_rate"], r["ttft_p50_s"], r["ttft_p99_s"], r["load_imbalance"]]
            for name, r in results.items()
        ],
    )
    figure, (left, right) = new_figure(2, width=7)
    names = list(results)
    left.bar(names, [results[n]["hit_rate"] for n in names])
    left.set_ylabel("prompt-token hit rate")
    right.bar(names, [results[n]["ttft_p50_s"] for n in names])
    right.set_ylabel("TTFT p50 (s)")
    report.figures["cache_key.png"] = figure
    report.results = {"settings": asdict(settings), "results": results}
    return report.write(output_dir)
