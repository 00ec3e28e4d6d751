"""``python -m benchmarks run SCENARIO [--output DIR] [--quick]``."""

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks import churn, http_load, prefix_ttft, reload_vs_recompute, routing, transfer
from benchmarks.sim import acceptance, router_micro, sim_vs_real, sweeps_scenario
from benchmarks.sim import calibrate as sim_calibrate
from benchmarks.sim import cli as sim_cli

SCENARIOS = {
    module.NAME: module
    for module in (
        prefix_ttft,
        reload_vs_recompute,
        churn,
        transfer,
        routing,
        http_load,
        router_micro,
        sim_vs_real,
        acceptance,
        sweeps_scenario,
    )
}
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "out"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="Strata benchmarks (see benchmarks/README.md)."
    )
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="list the scenarios")
    run = actions.add_parser("run", help="run a scenario and write its report")
    run.add_argument("scenario", choices=[*SCENARIOS, "all"])
    run.add_argument(
        "--output",
        type=Path,
        default=None,
        help="report folder (default benchmarks/out/SCENARIO; with 'all', DIR/SCENARIO)",
    )
    run.add_argument(
        "--quick", action="store_true", help="small sizes for a smoke test (< 60 s each)"
    )
    run.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice, usually one per core)",
    )
    simulate = actions.add_parser(
        "simulate", help="replay a trace through simulated replicas and routers (sim/)"
    )
    sim_cli.add_arguments(simulate)
    calibrate = actions.add_parser(
        "calibrate", help="fit a simulator hardware profile to the real engine (sim/)"
    )
    sim_calibrate.add_arguments(calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.action == "simulate":
        sim_cli.run(args, shlex.join(["python", "-m", "benchmarks", *argv]))
        return 0
    if args.action == "calibrate":
        sim_calibrate.run(args)
        return 0
    if args.action == "list":
        for name, module in SCENARIOS.items():
            print(f"{name:22} {module.__doc__.splitlines()[0].split(': ', 1)[1]}")
        return 0
    previous_threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        _run(args, shlex.join(["python", "-m", "benchmarks", *argv]))
    finally:
        torch.set_num_threads(previous_threads)
    return 0


def _run(args: argparse.Namespace, command: str) -> None:
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for name in names:
        if args.output is None:
            output_dir = DEFAULT_OUTPUT / name
        else:
            output_dir = args.output / name if args.scenario == "all" else args.output
        start = time.perf_counter()
        print(f"== {name}{' (quick)' * args.quick}, {torch.get_num_threads()} torch threads")
        SCENARIOS[name].run(output_dir, quick=args.quick, command=command)
        print(f"== {name} took {time.perf_counter() - start:.1f} s")
