"""curve-cost: memory and per-step time of the miss-ratio curve, sampled (the default) vs exact.

The trace-driven simulator (``benchmarks/sim``, hardware profile ``h200-llama8b``: 50k NPU
blocks of 16 tokens per replica, one simulated token per trace token) replays a synthetic trace
of Zipf-popular shared prefixes (prompts of about 15k tokens, about 1,000 blocks each) with a
host tier of ``host_memory_ratio`` x the NPU blocks, once with the default sample rate and once
with exact shadows (``KVOffloadConfig.miss_ratio_curve_sample_rate=1``), under the fixed and
the adaptive policy. The retention tracker's hooks (``RetentionTracker``: admission walks, NPU
and host evictions, promotions, landed transfers) are timed on this CPU, timer included; their
total over the run's engine steps is the tracking cost per step, set against the simulated
step time. A step pays about one hook call per block it allocates over a full NPU tier (an
eviction), so a decode step of ``B`` sequences pays about ``B / 16`` calls: ``us/call`` x
``B / 16`` against the profile's smallest decode step (5 ms).
Memory is the hashes the ghost lists and shadows hold at the end of the run (and at most),
at ``BYTES_PER_TRACKED_BLOCK`` (160) bytes each. The estimated host hit rates of both curves
are listed side by side.
"""

import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.report import Report, new_figure
from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.simulator import SimConfig, Simulator
from benchmarks.sim.trace import TraceRecord, expand
from replicas.kv.retention import RetentionTracker
from replicas.kv.retention.curve import BYTES_PER_TRACKED_BLOCK

NAME = "curve-cost"
PROFILE = "h200-llama8b"
BLOCK_SIZE = 16
HASH_ID_TOKENS = 512
HOOKS = ("admitted", "promotion_candidate", "npu_evicted", "host_evicted", "transfers_landed")


@dataclass(frozen=True, slots=True)
class Settings:
    num_requests: int = 1500
    num_prefixes: int = 600
    prefix_hash_ids: tuple[int, int] = (10, 40)
    zipf: float = 1.0
    interarrival_s: float = 0.25
    host_memory_ratio: float = 2.0
    seed: int = 0


QUICK = Settings(num_requests=200, num_prefixes=80)


def synthetic_trace(settings: Settings) -> list[TraceRecord]:
    rng = random.Random(settings.seed)
    next_id = iter(range(1 << 40))
    low, high = settings.prefix_hash_ids
    prefixes = [
        tuple(next(next_id) for _ in range(rng.randint(low, high)))
        for _ in range(settings.num_prefixes)
    ]
    weights = [1 / (i + 1) ** settings.zipf for i in range(settings.num_prefixes)]
    records = []
    for i in range(settings.num_requests):
        hash_ids = rng.choices(prefixes, weights)[0] + (next(next_id),)
        length = HASH_ID_TOKENS * len(hash_ids) - rng.randrange(HASH_ID_TOKENS)
        records.append(TraceRecord(1000 * settings.interarrival_s * i, length, 64, hash_ids))
    return records


@contextmanager
def timed_trackers(sample_rate: float | None):
    """Every ``RetentionTracker`` built meanwhile curves at ``sample_rate`` and times its
    hooks (timer included); yields ``{id: [tracker, seconds, calls]}``."""
    built: dict[int, list] = {}
    originals = {name: getattr(RetentionTracker, name) for name in (*HOOKS, "__init__")}

    def init(self, policy, context, rate=None, *args, **kwargs):
        originals["__init__"](self, policy, context, sample_rate, *args, **kwargs)
        built[id(self)] = [self, 0.0, 0]

    def timed(hook):
        def call(self, *args):
            start = time.perf_counter()
            hook(self, *args)
            cell = built[id(self)]
            cell[1] += time.perf_counter() - start
            cell[2] += 1

        return call

    RetentionTracker.__init__ = init
    for name in HOOKS:
        setattr(RetentionTracker, name, timed(originals[name]))
    try:
        yield built
    finally:
        for name, original in originals.items():
            setattr(RetentionTracker, name, original)


def measure(requests, retention: str, sample_rate: float | None, settings: Settings) -> dict:
    config = SimConfig(
        data_parallel_size=1,
        block_size=BLOCK_SIZE,
        tokens_per_hash_id=HASH_ID_TOKENS,
        token_scale=1.0,
        host_memory_ratio=settings.host_memory_ratio,
        retention=retention,
        max_num_batched_tokens=8192,
    )
    cost_model = CostModel(HardwareProfile.load(PROFILE), BLOCK_SIZE, 1.0)
    with timed_trackers(sample_rate) as built:
        simulator = Simulator(config, cost_model, requests)
        record = simulator.run()
    ((tracker, seconds, calls),) = built.values()  # one replica, one cache type
    engine = simulator.engines[0]
    curve = tracker.curve
    return {
        "retention": retention,
        "curve": "exact" if sample_rate == 1.0 else "sampled (default)",
        "num_host_blocks": simulator.num_host_blocks,
        "sample_rate": curve.sample_rate,
        "num_steps": engine.num_steps,
        "tracking_us_per_step": 1e6 * seconds / max(1, engine.num_steps),
        "tracking_share_of_busy_time": seconds / engine.busy_s if engine.busy_s else 0.0,
        "hook_calls": calls,
        "tracking_us_per_call": 1e6 * seconds / max(1, calls),
        "mean_step_ms": 1e3 * engine.busy_s / max(1, engine.num_steps),
        "hashes_held": curve.num_tracked(),
        "hashes_max": curve.max_tracked(),
        "bytes_max": curve.max_tracked() * BYTES_PER_TRACKED_BLOCK,
        "host_hit_rate": record["host_hit_rate"],
        "estimates": record["host_hit_rate_estimates"],
    }


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    requests = expand(synthetic_trace(settings), HASH_ID_TOKENS)
    rows = [
        measure(requests, retention, rate, settings)
        for retention in ("fixed", "adaptive")
        for rate in (None, 1.0)
    ]
    report = Report(
        NAME,
        f"Miss-ratio curve: memory and time per step, {settings.num_requests} requests, host "
        f"{settings.host_memory_ratio:g}x the NPU tier",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        "Cost of the curve (one replica, one cache type)",
        [
            "policy",
            "curve",
            "host blocks",
            "sample rate",
            "steps",
            "tracking us/step",
            "mean step ms",
            "% of step time",
            "hook calls",
            "us/call",
            "hashes held",
            "hashes at most",
            "MiB at most",
        ],
        [
            [
                r["retention"],
                r["curve"],
                r["num_host_blocks"],
                r["sample_rate"],
                r["num_steps"],
                r["tracking_us_per_step"],
                r["mean_step_ms"],
                100 * r["tracking_share_of_busy_time"],
                r["hook_calls"],
                r["tracking_us_per_call"],
                r["hashes_held"],
                r["hashes_max"],
                r["bytes_max"] / 2**20,
            ]
            for r in rows
        ],
    )
    keys = sorted({key for r in rows for key in r["estimates"]})
    report.add_table(
        "Estimated host hit rates (measured: the run's own host hit rate)",
        ["policy", "curve", "measured", *keys],
        [
            [r["retention"], r["curve"], r["host_hit_rate"]]
            + [r["estimates"].get(key, "") for key in keys]
            for r in rows
        ],
    )
    figure, (left, right) = new_figure(2, width=7)
    names = [f"{r['retention']}\n{r['curve'].split()[0]}" for r in rows]
    left.bar(names, [r["tracking_us_per_step"] for r in rows])
    left.set_ylabel("curve tracking (us per step)")
    right.bar(names, [r["bytes_max"] / 2**20 for r in rows])
    right.set_yscale("log")
    right.set_ylabel("hashes held at most (MiB)")
    report.figures["curve_cost.png"] = figure
    report.results = {"settings": asdict(settings), "runs": rows}
    return report.write(output_dir)
