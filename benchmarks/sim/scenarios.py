"""Configuration shared by the simulator scenarios (``sim-acceptance``, ``sim-sweeps``).

The base cluster: the shipped ``synthetic_trace.jsonl`` (one hash id = 16 tokens = one block;
a simulated token stands for 32 trace tokens), dp 8 replicas of one H200 serving Llama-3.1-8B
(``h200-llama8b``): 1,564 NPU blocks of 512 trace tokens (64 MiB) per replica, what 105 GB of
KV holds, 3.6% of the trace's 43,924 distinct blocks (28% at dp 8); a host tier of 1 TiB for
the whole cluster (128 GiB = 2,048 blocks per replica, NPU + host = 66% of the distinct blocks);
write-through threshold 2, no write-back; arrivals as recorded.
"""

import os
from pathlib import Path

from benchmarks.report import Report
from benchmarks.sim import report as sim_report
from benchmarks.sim.cli import DEFAULT_TRACE, POLICIES
from benchmarks.sim.cost_model import HardwareProfile
from benchmarks.sim.runs import Sweep, execute, plan_runs
from benchmarks.sim.simulator import SimConfig
from benchmarks.sim.trace import expand, load_trace, trace_summary

HARDWARE = "h200-llama8b"
BASE = SimConfig(data_parallel_size=8, host_memory_gb=1024.0, token_scale=32.0)
QUICK_REQUESTS = 300


def simulate(
    sweeps: list[Sweep], replicates: int, quick: bool, policies: list[str] = POLICIES
) -> tuple[list[dict[str, object]], dict[str, object]]:
    """Every run of a scenario on the base configuration; (records, trace summary)."""
    records = load_trace(DEFAULT_TRACE, QUICK_REQUESTS if quick else None)
    requests = expand(records, BASE.tokens_per_hash_id)
    runs = plan_runs(BASE, policies, ["balanced"], sweeps, replicates)
    print(f"{len(runs)} simulations of {len(requests)} requests", flush=True)
    jobs = min(2, os.cpu_count() or 1)
    results = execute(runs, requests, HardwareProfile.load(HARDWARE), jobs=jobs)
    return results, {"path": str(DEFAULT_TRACE), **trace_summary(records)}


def write(report: Report, results: list, trace: dict, output_dir: Path) -> dict[str, object]:
    report.add_table("Runs", sim_report.RUN_HEADERS, sim_report.run_rows(results))
    sim_report.add_sources(report, results)
    sim_report.ttft_cdf_figure(report, results)
    sim_report.sweep_figures(report, results)
    report.results.update(
        {
            "trace": trace,
            "hardware_profile": HARDWARE,
            "records": results,
            "policy_sources": sim_report.POLICY_SOURCES,
        }
    )
    return report.write(output_dir)
