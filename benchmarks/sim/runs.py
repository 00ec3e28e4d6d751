"""Batches of simulator runs: policies x sweep points x replicates, optionally in parallel.

A sweep varies one parameter of the base configuration at a time (not a cross product)::

    dp=1,2,4           data_parallel_size          host-gb=0,256,1024   host_memory_gb
    disk-gb=0,4096     disk_memory_gb
    threshold=0,1,2    write_through_threshold     host-ratio=0,1,2     host_memory_ratio
                       (CLI semantics: 0 disables) write-back[=off,on]  write_back
    npu-blocks=512,... num_npu_blocks              speedup=1,2,4        arrival_speedup
    profile[=balanced,locality,load]  Strata's scoring profile (Strata runs only)
    retention[=default,write-back,adaptive,clairvoyant]   host retention: the base config's
                       threshold without write-back, with write-back, adaptive, or the
                       clairvoyant bound (write_back, retention)

Replicate k > 0 of every run jitters arrivals and seeds the peers' tie-breaks with k
(``SimConfig.seed``); replicate 0 is the trace as recorded.
"""

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

from tqdm import tqdm

from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.simulator import CLAIRVOYANT, STRATA, SimConfig, Simulator
from benchmarks.sim.trace import TraceRequest
from replicas.kv.retention import IMMEDIATE


def write_through_threshold(text: str) -> "int | str":
    """A write-through threshold as the config reads it: hits, 0 (off) or ``immediate``."""
    if text == IMMEDIATE:
        return text
    value = int(text)
    if value < 0:
        raise ValueError(f"threshold must be >= 0 or {IMMEDIATE!r}, got {value}")
    return value


RETENTIONS = {
    "default": {"write_back": False, "retention": "fixed"},
    "write-back": {"write_back": True, "retention": "fixed"},
    "adaptive": {"write_back": False, "retention": "adaptive"},
    CLAIRVOYANT: {"write_back": False, "retention": CLAIRVOYANT},  # a bound: reads the future
}


def _retention(text: str) -> dict[str, object]:
    if text not in RETENTIONS:
        raise ValueError(f"retention values are {', '.join(RETENTIONS)}, got {text!r}")
    return RETENTIONS[text]


def _switch(text: str) -> bool:
    if text not in ("off", "on"):
        raise ValueError(f"write-back values are off and on, got {text!r}")
    return text == "on"


class SweepKind(NamedTuple):
    field: str
    parse: Callable[[str], object]
    default_values: tuple[str, ...] = ()


SWEEPS: dict[str, SweepKind] = {
    "dp": SweepKind("data_parallel_size", int),
    "host-gb": SweepKind("host_memory_gb", float),
    "host-ratio": SweepKind("host_memory_ratio", float),
    "disk-gb": SweepKind("disk_memory_gb", float),
    "threshold": SweepKind("write_through_threshold", write_through_threshold),
    "write-back": SweepKind("write_back", _switch, ("off", "on")),
    "npu-blocks": SweepKind("num_npu_blocks", int),
    "speedup": SweepKind("arrival_speedup", float),
    "profile": SweepKind("scoring_profile", str, ("balanced", "locality", "load")),
    "reservation": SweepKind("reservation_share", float, ("0", "0.2")),
    "prefetch": SweepKind("reservation_prefetch", _switch, ("off", "on")),
    "retention": SweepKind("", _retention, tuple(RETENTIONS)),  # sets two fields
    "overload": SweepKind("overload_factor", float, ("0", "16")),
}


class Sweep(NamedTuple):
    kind: str
    values: tuple[str, ...]


def parse_sweep(spec: str) -> Sweep:
    """``KIND=V1,V2`` (or ``write-back``, ``profile`` or ``retention`` alone) into a Sweep;
    ValueError if bad."""
    kind, _, values = spec.partition("=")
    if kind not in SWEEPS:
        raise ValueError(f"--sweep {spec}: unknown kind {kind!r}; one of {', '.join(SWEEPS)}")
    parsed = tuple(v.strip() for v in values.split(",") if v.strip()) or SWEEPS[kind].default_values
    if not parsed:
        raise ValueError(f"--sweep {spec}: give values, e.g. {kind}=1,2,4")
    for value in parsed:
        SWEEPS[kind].parse(value)
    return Sweep(kind, parsed)


class Run(NamedTuple):
    config: SimConfig
    sweep: str | None
    sweep_value: str | None


def plan_runs(
    base: SimConfig,
    policies: Sequence[str],
    profiles: Sequence[str],
    sweeps: Sequence[Sweep],
    replicates: int,
) -> list[Run]:
    """Every run of a batch: the base point for each policy (Strata once per profile), then
    each sweep point, each in ``replicates`` replicates."""
    points: list[tuple[SimConfig, str | None, str | None]] = []

    def add(config: SimConfig, sweep: str | None, value: str | None) -> None:
        for policy in policies:
            names = profiles if policy == STRATA else profiles[:1]
            if sweep == "profile" and policy != STRATA:
                continue
            for profile in names if sweep != "profile" else [config.scoring_profile]:
                points.append(
                    (
                        dataclasses.replace(config, policy=policy, scoring_profile=profile),
                        sweep,
                        value,
                    )
                )

    add(base, None, None)
    for sweep in sweeps:
        kind = SWEEPS[sweep.kind]
        for value in sweep.values:
            changes = {kind.field: kind.parse(value)} if kind.field else kind.parse(value)
            if sweep.kind == "host-gb":
                changes["host_memory_ratio"] = 0.0
            elif sweep.kind == "host-ratio":
                changes["host_memory_gb"] = 0.0
            add(dataclasses.replace(base, **changes), sweep.kind, value)
    return [
        Run(dataclasses.replace(config, seed=seed), sweep, value)
        for config, sweep, value in points
        for seed in range(replicates)
    ]


_REQUESTS: list[TraceRequest] = []
_PROFILE: HardwareProfile | None = None


def _init(requests: list[TraceRequest], profile: HardwareProfile) -> None:
    global _REQUESTS, _PROFILE  # one copy per worker process, set once by the pool
    _REQUESTS, _PROFILE = requests, profile


def _simulate(run: Run, progress: bool = False) -> dict[str, object]:
    config = run.config
    cost_model = CostModel(_PROFILE, config.block_size, config.token_scale)
    record = Simulator(config, cost_model, _REQUESTS).run(progress=progress)
    return {**record, "sweep": run.sweep, "sweep_value": run.sweep_value}


def execute(
    runs: Sequence[Run],
    requests: list[TraceRequest],
    profile: HardwareProfile,
    *,
    jobs: int = 1,
    progress: bool = True,
) -> list[dict[str, object]]:
    """Run every simulation (in ``jobs`` processes); records in the order of ``runs``."""
    if jobs <= 1 or len(runs) == 1:
        _init(requests, profile)
        inner = progress and len(runs) == 1
        return [
            _simulate(run, inner)
            for run in tqdm(runs, desc="runs", disable=not progress or len(runs) == 1)
        ]
    with ProcessPoolExecutor(jobs, initializer=_init, initargs=(requests, profile)) as pool:
        results = pool.map(_simulate, runs)
        return list(tqdm(results, total=len(runs), desc="runs", disable=not progress))
