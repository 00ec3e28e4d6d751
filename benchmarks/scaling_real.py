"""The real part of ``scaling``: the ``tiny`` model through the Ray deployment, resized 1 -> 3 -> 1
under a shared-prefix load that ramps up and down, once per variant.

Each variant replays the same arrivals (seeded: Zipf-skewed tenants' prompts plus a unique
question, at the rate of the phase they fall in) against a fresh deployment on one Ray
instance, the same disk directory for its disk tier (emptied between variants)::

    0 ........ t_out ............... t_in ............ end      (Settings.phases, seconds)
      dp 1, low rate   dp 3, high rate     dp 1, low rate

``cache-aware`` and ``random`` resize the running deployment (``RayBackend.scale``, with
``victim="value"`` or ``"random"``); ``restart`` shuts it down and starts a new deployment at
the new size on the same disk directory: requests in flight then fail, and arrivals wait for
the new deployment (their TTFT counts the wait). The windows that stand for the issue's
"minute" are ``Settings.window_s`` long.
"""

import asyncio
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray

from benchmarks.workload import kv_block_bytes, random_tokens
from cluster.config import ClusterConfig
from cluster.deploy import RayBackend
from replicas.sampling_params import SamplingParams

VARIANTS = ("cache-aware", "random", "restart")
VICTIMS = {"cache-aware": "value", "random": "random"}
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Settings:
    num_tenants: int = 24
    prefix_len: int = 256  # 16 blocks
    question_len: int = 16
    max_tokens: int = 4
    zipf_s: float = 0.8
    phases: tuple[tuple[float, int, float], ...] = ((0.0, 1, 2.0), (30.0, 3, 6.0), (80.0, 1, 2.0))
    """(start s, data_parallel_size, arrivals per second) per phase."""
    end_s: float = 115.0
    window_s: float = 20.0
    num_npu_blocks: int = 128  # per replica: about 8 of the 24 tenants' prefixes
    host_memory_ratio: float = 1.0
    ramp_s: float = 10.0  # the default 30 s scaled as the window is (60 s -> 20 s)
    seed: int = 0


@dataclass(slots=True)
class Served:
    arrival_s: float
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    replica: str | None = None  # "generation/index": a restart starts a new generation
    error: str | None = None


@dataclass(slots=True)
class _Deployment:
    """The backend requests go to; ``ready`` is clear while a restart replaces it."""

    backend: RayBackend | None = None
    generation: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


def run_real(output_dir: Path, settings: Settings = Settings()) -> dict[str, dict]:
    """Every variant's record (``_record``)."""
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    output_dir.mkdir(parents=True, exist_ok=True)
    disk_dir = Path(tempfile.mkdtemp(prefix="scaling-disk-", dir=output_dir))
    try:
        records = {}
        for variant in VARIANTS:
            shutil.rmtree(disk_dir, ignore_errors=True)
            disk_dir.mkdir()
            records[variant] = asyncio.run(_run_variant(variant, settings, disk_dir))
        return records
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        if started_ray:
            ray.shutdown()


def _config(settings: Settings, size: int, disk_dir: Path) -> ClusterConfig:
    working_set_blocks = settings.num_tenants * settings.prefix_len // BLOCK_SIZE
    block_bytes = kv_block_bytes("tiny", "float32")
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": size,
            "model": {"model": "tiny", "num_npu_blocks": settings.num_npu_blocks},
            "scheduler": {
                "kv_offload_config": {
                    "enabled": True,
                    "host_memory_ratio": settings.host_memory_ratio,
                    # every block to host at its first write, and so to disk (0 would turn
                    # write-through off: blocks would reach disk only at a write-out)
                    "write_through_threshold": "immediate",
                    "disk_path": str(disk_dir),
                    "disk_bytes": 4 * working_set_blocks * block_bytes,
                }
            },
            "routing": {"ramp_s": settings.ramp_s},
            "server": {"drain_timeout_s": 5.0},
            "ray": {"cpus_per_replica": 1.0, "use_for_one_replica": True},
        }
    )


def _arrivals(settings: Settings) -> list[tuple[float, list[int]]]:
    """(arrival s, prompt) of the whole run: Poisson arrivals at each phase's rate."""
    rng = random.Random(settings.seed)
    prefixes = [random_tokens(rng, settings.prefix_len) for _ in range(settings.num_tenants)]
    weights = [1 / (k + 1) ** settings.zipf_s for k in range(settings.num_tenants)]
    arrivals, now = [], 0.0
    while True:
        rate = [r for start, _, r in settings.phases if start <= now][-1]
        now += rng.expovariate(rate)
        if now >= settings.end_s:
            return arrivals
        tenant = rng.choices(range(settings.num_tenants), weights)[0]
        arrivals.append((now, prefixes[tenant] + random_tokens(rng, settings.question_len)))


async def _run_variant(variant: str, settings: Settings, disk_dir: Path) -> dict:
    name = f"bench-scaling-{variant}"
    deployment = _Deployment()
    deployment.backend = await asyncio.to_thread(RayBackend, _config(settings, 1, disk_dir), name)
    deployment.ready.set()
    params = SamplingParams(max_tokens=settings.max_tokens, ignore_eos=True)
    served: list[Served] = []
    resizes: list[dict] = []
    current = [1]  # the deployment's size
    start = time.perf_counter()

    async def one(index: int, arrival_s: float, prompt: list[int]) -> None:
        await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
        record = Served(arrival_s, len(prompt))
        served.append(record)
        await deployment.ready.wait()
        generation, backend = deployment.generation, deployment.backend
        final = None
        try:
            async for output in backend.generate(f"{variant}-{index}", prompt, params):
                if record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - start - arrival_s
                final = output
        except Exception as error:  # counted: the targets say none may fail
            record.error = f"{type(error).__name__}: {error}"
            return
        record.num_cached_tokens = final.num_cached_tokens
        record.replica = f"{generation}/{final.replica_index}"

    async def resize(at_s: float, size: int) -> None:
        await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
        began = time.perf_counter() - start
        entry: dict = {"time_s": began, "from": current[0], "to": size}
        entry["num_disk_blocks"] = await _num_disk_blocks(deployment.backend)
        current[0] = size
        if variant == "restart":
            entry.update(await _restart(deployment, settings, size, disk_dir, name))
        else:
            result = await deployment.backend.scale(size, victim=VICTIMS[variant])
            entry["removed"] = list(result.removed)
            entry["reasons"] = {str(k): v for k, v in result.reasons.items()}
            entry["added"] = [f"{deployment.generation}/{i}" for i in result.added]
        entry["ready_s"] = time.perf_counter() - start
        resizes.append(entry)

    arrivals = _arrivals(settings)
    tasks = [one(i, t, p) for i, (t, p) in enumerate(arrivals)]
    tasks += [resize(t, size) for t, size, _ in settings.phases[1:]]
    try:
        await asyncio.gather(*tasks)
        for report in await deployment.backend.check_integrity():
            if report["npu_blocks_used"] or report["num_unfinished"]:
                raise RuntimeError(f"blocks left in use after the run: {report}")
    finally:
        deployment.backend.shutdown()
    return _record(variant, settings, served, resizes)


async def _num_disk_blocks(backend: RayBackend) -> int:
    """The blocks the node's disk tier holds (every member's own slab): with every block
    written through, the working set once each prefix was computed."""
    stats = await backend.stats()
    return sum(
        disk.num_cached
        for replica in stats.replicas
        if replica.engine is not None
        for disk in replica.engine.backing.get("disk", {}).values()
    )


async def _restart(
    deployment: _Deployment, settings: Settings, size: int, disk_dir: Path, name: str
) -> dict:
    """Replace the deployment by a new one of ``size`` replicas (requests in flight fail)."""
    deployment.ready.clear()
    deployment.backend.shutdown()
    deployment.generation += 1
    config = _config(settings, size, disk_dir)
    deployment.backend = await asyncio.to_thread(
        RayBackend, config, f"{name}-{deployment.generation}"
    )
    deployment.ready.set()
    return {"added": [f"{deployment.generation}/{i}" for i in range(size)]}


def _record(variant: str, settings: Settings, served: list[Served], resizes: list[dict]) -> dict:
    window = settings.window_s
    done = [s for s in served if s.error is None]
    for entry in resizes:
        t = entry["time_s"]
        before = _hit_rate(s for s in done if t - window <= s.arrival_s < t)
        after = _hit_rate(s for s in done if t <= s.arrival_s < t + window)
        entry.update(
            hit_rate_before=before,
            hit_rate_after=after,
            after_over_before=after / before if before else None,
        )
    new_replicas = []
    for entry in resizes:
        ready = entry["ready_s"]
        in_window = [s for s in done if ready <= s.arrival_s < ready + window]
        cluster = _hit_rate(in_window)
        for replica in entry.get("added", []):
            mine = [s for s in in_window if s.replica == replica]
            new_replicas.append(
                {
                    "replica": replica,
                    "start_s": ready,
                    "num_requests_first_window": len(mine),
                    "hit_rate_first_window": _hit_rate(mine),
                    "cluster_hit_rate": cluster,
                    "ratio": _hit_rate(mine) / cluster if mine and cluster else None,
                }
            )
    ttfts = sorted(s.ttft_s for s in done)
    return {
        "victim_rule": variant,
        "settings": asdict(settings),
        "working_set_blocks": settings.num_tenants * settings.prefix_len // BLOCK_SIZE,
        "num_requests": len(served),
        "num_failed": len(served) - len(done),
        "errors": sorted({s.error for s in served if s.error})[:5],
        "num_interrupted": 0,  # a restart's lost requests are failed ones here
        "hit_rate": _hit_rate(done),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else 0.0,
        "resizes": resizes,
        "new_replicas": new_replicas,
        "timeline": _timeline(done, resizes),
    }


def _timeline(done: list[Served], resizes: list[dict], bin_s: float = 5.0) -> list[dict]:
    bins: dict[int, list[Served]] = {}
    for s in done:
        bins.setdefault(int(s.arrival_s // bin_s), []).append(s)
    return [
        {
            "time_s": b * bin_s,
            "hit_rate": _hit_rate(bins[b]),
            "ttft_mean_s": sum(s.ttft_s for s in bins[b]) / len(bins[b]),
        }
        for b in sorted(bins)
    ]


def _hit_rate(served) -> float:
    served = list(served)
    prompt = sum(s.num_prompt_tokens for s in served)
    return sum(s.num_cached_tokens for s in served) / prompt if prompt else 0.0
