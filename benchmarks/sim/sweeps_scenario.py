"""sim-sweeps: every routing policy vs dp, host budget, threshold, write-back, profile, rate.

On the shipped trace: data-parallel size, host budget, write-through threshold, write-back,
Strata's scoring profile and arrival rate.
One parameter varies at a time around the base configuration (``benchmarks/sim/scenarios.py``);
one replicate per point. Plots: hit rate, TTFT p50 and load imbalance against each parameter.
"""

from pathlib import Path

from benchmarks.report import Report
from benchmarks.sim import scenarios
from benchmarks.sim.runs import parse_sweep

NAME = "sim-sweeps"
SWEEPS = (
    "dp=1,2,4,8,16,32,64",
    "host-gb=0,256,512,1024,2048,4096",
    "threshold=0,1,2,4",
    "write-back",
    "profile",
    "speedup=1,1.5,2,3",
)
QUICK_SWEEPS = ("dp=2,8", "host-gb=0,1024", "write-back", "profile")


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    sweeps = [parse_sweep(s) for s in (QUICK_SWEEPS if quick else SWEEPS)]
    results, trace = scenarios.simulate(sweeps, 1, quick)
    report = Report(
        NAME,
        "Simulated routing policies across cluster parameters",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip() + "\n\n" + scenarios.__doc__.split("\n\n")[1].strip(),
    )
    report.results = {"sweeps": [s.kind for s in sweeps]}
    return scenarios.write(report, results, trace, output_dir)
