"""router-micro: routing decision time vs prompt length and prefix-index size, in process.

``Router.route`` (score -> choose -> charge; the prompt's block hashes given, as the HTTP app
computes them once) on a router whose virtual prefix index holds N blocks spread over dp 8
replicas, fed through ``on_events`` like a live cluster. Each replica's blocks are chains of
random 16-byte hashes; each timed prompt follows one stored chain for half its blocks and then
leaves it, so the index scans a real match on one replica and misses on the others. Decisions
are released right after (no load build-up); the points take turns in 5 rounds. Target:
p50 <= 100 us for an 8k-token prompt with 1M indexed blocks at dp 8. Hashing the prompt
(``replicas.kv.hashing``) is timed for reference.
"""

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.report import Report, new_figure
from benchmarks.workload import percentile
from replicas.kv.events import KVEvent, KVEventBatch
from replicas.kv.hashing import block_hashes
from router.config import RoutingConfig
from router.router import Router

NAME = "router-micro"
BLOCK_SIZE = 16
TARGET_S = 100e-6
ROUNDS = 5


@dataclass(frozen=True, slots=True)
class Settings:
    num_replicas: int = 8
    index_blocks: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    prompt_tokens: tuple[int, ...] = (512, 2048, 8192, 32768)
    chain_blocks: int = 2048  # length of each stored chain (a long conversation)
    samples: int = 300
    seed: int = 0


QUICK = Settings(index_blocks=(10_000, 100_000), prompt_tokens=(512, 8192), samples=60)


def build_router(settings: Settings, num_blocks: int, rng: random.Random) -> tuple[Router, list]:
    """A router indexing ``num_blocks`` blocks (chains spread over the replicas)."""
    router = Router(settings.num_replicas, BLOCK_SIZE, RoutingConfig())
    chains = []
    next_seq = [0] * settings.num_replicas
    stored = 0
    while stored < num_blocks:
        length = min(settings.chain_blocks, num_blocks - stored)
        chain = [rng.randbytes(16) for _ in range(length)]
        replica = len(chains) % settings.num_replicas
        events = tuple(KVEvent("stored", "npu", h) for h in chain)
        router.on_events(KVEventBatch(replica, next_seq[replica], events))
        next_seq[replica] += len(events)
        chains.append(chain)
        stored += length
    return router, chains


def time_routes(
    router: Router, chains: list, prompt_tokens: int, samples: int, rng: random.Random
) -> list[float]:
    num_blocks = prompt_tokens // BLOCK_SIZE
    times = []
    for i in range(samples + 3):  # the first 3 warm up
        chain = rng.choice(chains)
        shared = chain[: min(len(chain), num_blocks // 2)]
        prompt = shared + [rng.randbytes(16) for _ in range(num_blocks - len(shared))]
        start = time.perf_counter()
        router.route(f"r{i}", prompt_tokens, prompt)
        elapsed = time.perf_counter() - start
        router.release(f"r{i}")
        if i >= 3:
            times.append(elapsed)
    return times


def hashing_time(prompt_tokens: int, rng: random.Random, samples: int = 20) -> float:
    tokens = [rng.randrange(256) for _ in range(prompt_tokens)]
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        block_hashes(tokens, BLOCK_SIZE)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    rng = random.Random(settings.seed)
    routers, build_s = {}, {}
    for num_blocks in settings.index_blocks:
        start = time.perf_counter()
        routers[num_blocks] = build_router(settings, num_blocks, rng)
        build_s[num_blocks] = time.perf_counter() - start
        print(f"index of {num_blocks} blocks built", flush=True)
    samples: dict[tuple[int, int], list[float]] = {
        (n, length): [] for n in settings.index_blocks for length in settings.prompt_tokens
    }
    for _ in range(ROUNDS):  # points take turns, so noise on this machine falls on all alike
        for (num_blocks, prompt_tokens), times in samples.items():
            router, chains = routers[num_blocks]
            times += time_routes(router, chains, prompt_tokens, settings.samples // ROUNDS, rng)
    points = [
        {
            "index_blocks": num_blocks,
            "prompt_tokens": prompt_tokens,
            "p50_s": percentile(times, 50),
            "p99_s": percentile(times, 99),
            "mean_s": statistics.fmean(times),
            "index_build_s": build_s[num_blocks],
        }
        for (num_blocks, prompt_tokens), times in samples.items()
    ]
    hashing = {n: hashing_time(n, rng) for n in settings.prompt_tokens}
    return _report(settings, points, hashing, command, quick).write(output_dir)


def _report(
    settings: Settings, points: list[dict], hashing: dict[int, float], command: str, quick: bool
) -> Report:
    report = Report(NAME, "Routing decision time", command, quick, __doc__.split("\n\n", 1)[1])
    target = next(
        (p for p in points if p["index_blocks"] == 1_000_000 and p["prompt_tokens"] == 8192), None
    )
    rows = [
        [
            p["index_blocks"],
            p["prompt_tokens"],
            p["p50_s"] * 1e6,
            p["p99_s"] * 1e6,
            hashing[p["prompt_tokens"]] * 1e6,
            (p["p50_s"] <= TARGET_S) if p is target else "",
        ]
        for p in points
    ]
    report.add_table(
        f"Router.route at dp {settings.num_replicas}, {settings.samples} decisions per point (us)",
        ["indexed blocks", "prompt tokens", "p50", "p99", "hashing the prompt (p50)", "target"],
        rows,
    )
    figure, (axis,) = new_figure(1, width=7.0)
    for num_blocks in settings.index_blocks:
        mine = [p for p in points if p["index_blocks"] == num_blocks]
        axis.plot(
            [p["prompt_tokens"] for p in mine],
            [p["p50_s"] * 1e6 for p in mine],
            marker="o",
            label=f"{num_blocks:,} blocks indexed (p50)",
        )
    axis.axhline(TARGET_S * 1e6, linestyle="--", color="black", linewidth=0.8, label="target")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(list(settings.prompt_tokens), [str(n) for n in settings.prompt_tokens])
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("route() time (us)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    report.figures["router_micro.png"] = figure
    report.results = {
        "settings": asdict(settings),
        "points": points,
        "hashing_p50_s": {str(k): v for k, v in hashing.items()},
        "target_p50_s": TARGET_S,
        "target_met": None if target is None else target["p50_s"] <= TARGET_S,
    }
    return report
