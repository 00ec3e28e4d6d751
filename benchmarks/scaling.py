"""scaling: resizing a running deployment, live (cache-aware or random victim) vs a restart.

Two parts, the same three variants side by side:

* **simulator** (``benchmarks.sim.resize``): the Mooncake-format trace
  ``benchmarks/traces/synthetic_trace.jsonl`` on ``h200-llama8b`` replicas with a host and a
  shared disk tier, resized 16 -> 32 -> 16 -> 8 at fixed fractions of the trace's span
  (``SIM_SCHEDULE``);
* **real** (``benchmarks.scaling_real``, left out by ``--quick``): the built-in ``tiny`` model
  through the Ray deployment, a shared-prefix load that ramps up and down while the deployment
  goes 1 -> 3 -> 1 (``RayBackend.scale``, which ``LLM.scale`` wraps), with a disk tier holding
  the working set; windows of 20 s stand for the targets' minute.

Variants: ``cache-aware`` (a scale-in removes the replica whose blocks the cluster can best do
without, ``cluster.scaling``), ``random`` (a replica drawn at random) and ``restart`` (every
replica replaced, empty, at the new size). Reported per variant: failed requests (target 0),
the hit rate in the minute after each scale-in over the minute before (target >= 0.95), and a
new replica's hit rate in its first minute over the cluster's (target >= 0.8 with the disk tier
holding the working set); TTFT and hit rate over time in ``scaling_sim.png`` and
``scaling_real.png``.
"""

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from matplotlib.figure import Figure

from benchmarks.report import Report, new_figure
from benchmarks.scaling_real import Settings, run_real
from benchmarks.sim.cli import DEFAULT_TRACE
from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.resize import VICTIM_RULES, Resize, ResizingSimulator
from benchmarks.sim.simulator import SimConfig
from benchmarks.sim.trace import expand, load_trace

NAME = "scaling"
HARDWARE = "h200-llama8b"
SIM_SCHEDULE = ((0.25, 32), (0.5, 16), (0.75, 8))  # (fraction of the trace's span, size)
SIM_START = 16
SCALE_IN_TARGET = 0.95
NEW_REPLICA_TARGET = 0.8
QUICK_REQUESTS = 400


def sim_config(quick: bool) -> SimConfig:
    """Every host block is stored to the disk tier too (write-through ``immediate``), so the disk
    holds the working set; arrivals 6x the trace's pace (4x quick), a load the added
    replicas are needed for (at the trace's pace 16 replicas idle and a new one receives only
    the cold prompts the others do not hold)."""
    return SimConfig(
        data_parallel_size=SIM_START,
        host_memory_gb=512.0,
        disk_memory_gb=16384.0,
        announce_disk_blocks=True,  # the router credits the node's disk blocks, as deployed
        write_through_threshold="immediate",
        token_scale=32.0,
        arrival_speedup=4.0 if quick else 6.0,
    )


def simulate_variant(rule: str, quick: bool, window_s: float) -> dict[str, object]:
    """One variant's record (a top-level function: it runs in a worker process)."""
    records = load_trace(DEFAULT_TRACE, QUICK_REQUESTS if quick else None)
    config = sim_config(quick)
    requests = expand(records, config.tokens_per_hash_id)
    span = max(r.arrival_s for r in requests) / config.arrival_speedup
    resizes = [Resize(fraction * span, size) for fraction, size in SIM_SCHEDULE]
    cost_model = CostModel(HardwareProfile.load(HARDWARE), config.block_size, config.token_scale)
    simulator = ResizingSimulator(config, cost_model, requests, resizes, rule, window_s)
    return simulator.run()


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    window_s = 15.0 if quick else 60.0
    jobs = min(len(VICTIM_RULES), os.cpu_count() or 1)
    with ProcessPoolExecutor(jobs) as pool:
        futures = {r: pool.submit(simulate_variant, r, quick, window_s) for r in VICTIM_RULES}
        sim = {rule: future.result() for rule, future in futures.items()}
    report = Report(
        NAME,
        "Resizing a running deployment: live resize (cache-aware or random victim) vs restart",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    summary = {rule: summarize(record) for rule, record in sim.items()}
    report.add_table(
        f"Simulator: {HARDWARE}, {DEFAULT_TRACE.name}, dp {SIM_START} -> "
        + " -> ".join(str(n) for _, n in SIM_SCHEDULE)
        + f", windows of {window_s:g} s",
        ["variant", *SUMMARY_HEADERS],
        [[rule, *(s[h] for h in SUMMARY_HEADERS)] for rule, s in summary.items()],
    )
    report.add_table(
        "Simulator: each resize (hit rate of the arrivals in the window before and after)",
        ["variant", "time s", "from", "to", "removed", "before", "after", "after / before"],
        [
            [rule, e["time_s"], e["from"], e["to"], e.get("removed", [])]
            + [e["hit_rate_before"], e["hit_rate_after"], e["after_over_before"]]
            for rule, record in sim.items()
            for e in record["resizes"]
        ],
    )
    report.figures["scaling_sim.png"] = timeline_figure(sim)
    real = {} if quick else run_real(output_dir)
    if real:
        _add_real(report, real)
    report.results = {
        "hardware_profile": HARDWARE,
        "trace": str(DEFAULT_TRACE),
        "window_s": window_s,
        "targets": {"scale_in": SCALE_IN_TARGET, "new_replica": NEW_REPLICA_TARGET},
        "sim": {"summary": summary, "records": sim},
        "real": {"summary": {r: summarize(rec) for r, rec in real.items()}, "records": real},
    }
    return report.write(output_dir)


def _add_real(report: Report, real: dict[str, dict]) -> None:
    settings = Settings()
    phases = ", ".join(f"dp {n} at {rate:g}/s from {t:g} s" for t, n, rate in settings.phases)
    report.add_table(
        f"Real: tiny through Ray, {phases}, to {settings.end_s:g} s; {settings.num_tenants} "
        f"tenants x {settings.prefix_len}-token prefixes; windows of {settings.window_s:g} s",
        ["variant", *SUMMARY_HEADERS],
        [[rule, *(summarize(rec)[h] for h in SUMMARY_HEADERS)] for rule, rec in real.items()],
    )
    report.add_table(
        "Real: each resize (hit rate of the arrivals in the window before and after)",
        ["variant", "time s", "ready s", "from", "to", "removed", "disk blocks"]
        + ["before", "after", "ratio"],
        [
            [rule, e["time_s"], e["ready_s"], e["from"], e["to"], e.get("removed", [])]
            + [e["num_disk_blocks"]]
            + [e["hit_rate_before"], e["hit_rate_after"], e["after_over_before"]]
            for rule, rec in real.items()
            for e in rec["resizes"]
        ],
    )
    report.figures["scaling_real.png"] = timeline_figure(real)


SUMMARY_HEADERS = (
    "num_failed",
    "num_interrupted",
    "hit_rate",
    "ttft_mean_s",
    "ttft_p99_s",
    "min_scale_in_ratio",
    "scale_in_met",
    "new_replica_requests",
    "new_replica_mean_hit_rate",
    "new_replica_ratio",
    "min_new_replica_ratio",
    "new_replica_met",
)


def summarize(record: dict) -> dict[str, object]:
    """One variant's figures against the targets: the worst scale-in (a scale-in is the restart
    variant's every resize to fewer replicas too); the new replicas' pooled first-window hit
    rate over the cluster's in the same windows (the target), and the worst single one."""
    scale_ins = [
        e["after_over_before"]
        for e in record["resizes"]
        if e["to"] < e["from"] and e["after_over_before"] is not None
    ]
    new = [n["ratio"] for n in record["new_replicas"] if n["ratio"] is not None]
    new_requests = sum(n["num_requests_first_window"] for n in record["new_replicas"])
    new_hits = sum(
        n["hit_rate_first_window"] * n["num_requests_first_window"] for n in record["new_replicas"]
    )
    cluster_hits = sum(
        n["cluster_hit_rate"] * n["num_requests_first_window"] for n in record["new_replicas"]
    )
    worst_in = min(scale_ins, default=None)
    worst_new = min(new, default=None)
    pooled = new_hits / cluster_hits if cluster_hits else None
    return {
        "num_failed": record["num_failed"],
        "num_interrupted": record["num_interrupted"],
        "hit_rate": record["hit_rate"],
        "ttft_mean_s": record["ttft_mean_s"],
        "ttft_p99_s": record["ttft_p99_s"],
        "min_scale_in_ratio": worst_in,
        "scale_in_met": worst_in is not None and worst_in >= SCALE_IN_TARGET,
        "new_replica_requests": new_requests,
        "new_replica_mean_hit_rate": new_hits / new_requests if new_requests else None,
        "new_replica_ratio": pooled,
        "min_new_replica_ratio": worst_new,
        "new_replica_met": pooled is not None and pooled >= NEW_REPLICA_TARGET,
    }


def timeline_figure(records: dict[str, dict]) -> Figure:
    """Hit rate and mean TTFT per 10 s of arrivals, one line per variant, resizes marked."""
    figure, (hits, ttft) = new_figure(2, width=6.5)
    for rule, record in records.items():
        rows = record["timeline"]
        times = [r["time_s"] for r in rows]
        hits.plot(times, [r["hit_rate"] for r in rows], label=rule, linewidth=1)
        ttft.plot(times, [r["ttft_mean_s"] for r in rows], label=rule, linewidth=1)
    for entry in next(iter(records.values()))["resizes"]:
        for axis in (hits, ttft):
            axis.axvline(entry["time_s"], color="grey", linestyle=":", linewidth=0.8)
        hits.annotate(f"->{entry['to']}", (entry["time_s"], 1.0), fontsize=7)
    hits.set(xlabel="arrival time (s)", ylabel="token hit rate", ylim=(0, 1.05))
    ttft.set(xlabel="arrival time (s)", ylabel="mean TTFT (s)", yscale="log")
    hits.legend(fontsize=8)
    return figure
