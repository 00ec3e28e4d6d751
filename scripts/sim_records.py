"""The simulator's records on fixed configurations and seeds, and a field-for-field comparison.

Restructuring the KV cache or the engine must leave the simulator's records unchanged except
wall time; this script makes that checkable against another tree (an older checkout)::

    # records of the tree on PYTHONPATH (run it once per tree)
    PYTHONPATH=. python scripts/sim_records.py run --output /tmp/sim_new.json
    cd OLD && PYTHONPATH=. python NEW/scripts/sim_records.py run --output /tmp/sim_old.json
    # every field that differs, per run (wall time ignored); exit status 1 if any
    # (a run that raised is recorded as {"error": ...}, so it differs in every field)
    python scripts/sim_records.py compare /tmp/sim_old.json /tmp/sim_new.json

Only ``SimConfig``, ``Simulator``, ``CostModel``, ``HardwareProfile``, ``load_trace`` and
``expand`` are used, so the script runs against any tree that has them. Python's hash seed is
fixed (the script re-executes itself with ``PYTHONHASHSEED=0``) so that set iteration orders,
and with them tie-breaks, are the same in both runs.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

WALL_FIELDS = frozenset({"sim_wall_s"})
"""Record fields that measure the machine, not the simulation."""

TRACE = Path("benchmarks") / "traces" / "synthetic_trace.jsonl"
MAX_REQUESTS = None  # the whole trace: 3,993 requests, enough reuse to fill every tier
SEEDS = (0, 1)  # seed 0: the trace's arrivals; seed 1: jittered arrivals, reseeded ties

BASE = {"data_parallel_size": 4, "num_npu_blocks": 256, "max_num_seqs": 32}
"""Small replicas, so that every tier sees evictions and reservations on this trace."""

HYBRID = {"sliding_window": 256, "sliding_layer_fraction": 0.5}

CONFIGS: dict[str, dict[str, object]] = {
    "no-host": {},
    "host-ratio-1": {"host_memory_ratio": 1.0},
    "host-ratio-1-threshold-off": {"host_memory_ratio": 1.0, "write_through_threshold": 0},
    "host-ratio-2-write-back": {"host_memory_ratio": 2.0, "write_back": True},
    "host-gb-adaptive": {"host_memory_gb": 64.0, "retention": "adaptive"},
    "host-ratio-1-fixed": {"host_memory_ratio": 1.0, "retention": "fixed"},
    "host-ratio-1-adaptive": {"host_memory_ratio": 1.0, "retention": "adaptive"},
    "host-ratio-1-clairvoyant": {"host_memory_ratio": 1.0, "retention": "clairvoyant"},
    "reservations-prefetch": {"host_memory_ratio": 1.0, "reservation_share": 0.2},
    "reservations-no-prefetch": {
        "host_memory_ratio": 1.0,
        "reservation_share": 0.2,
        "reservation_prefetch": False,
    },
    "hybrid-no-host": {**HYBRID},
    "hybrid-write-back-reservations": {
        **HYBRID,
        "host_memory_ratio": 1.0,
        "write_back": True,
        "reservation_share": 0.2,
    },
    "hybrid-adaptive": {**HYBRID, "host_memory_ratio": 1.0, "retention": "adaptive"},
    "disk": {"host_memory_ratio": 0.5, "disk_memory_gb": 64.0},
    "disk-write-back-reservations": {
        "host_memory_ratio": 0.5,
        "disk_memory_gb": 64.0,
        "write_back": True,
        "reservation_share": 0.2,
    },
    "ttft-profile-host": {"host_memory_ratio": 1.0, "scoring_profile": "ttft"},
    "peer-sglang-host": {"host_memory_ratio": 1.0, "policy": "sglang-cache-aware"},
}
"""Named runs: changes to ``SimConfig`` over ``BASE`` (every one runs once per seed)."""


def run_all(tree: Path, names: list[str]) -> dict[str, dict[str, object]]:
    """Every named configuration x seed on the tree importable as ``benchmarks``."""
    import benchmarks.sim.simulator as simulator
    from benchmarks.sim.cost_model import CostModel, HardwareProfile
    from benchmarks.sim.trace import expand, load_trace

    print(f"simulator from {Path(simulator.__file__).resolve()}", file=sys.stderr)
    profile = HardwareProfile.load("h200-llama8b")
    requests = expand(load_trace(tree / TRACE, MAX_REQUESTS), 16)
    runs: dict[str, dict[str, object]] = {}
    for name in names:
        for seed in SEEDS:
            start = time.perf_counter()
            try:
                config = simulator.SimConfig(**BASE, **CONFIGS[name], seed=seed)
                cost_model = CostModel(profile, config.block_size, config.token_scale)
                record = simulator.Simulator(config, cost_model, requests).run()
            except Exception as error:  # recorded, so that the other runs still compare
                record = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name} seed {seed}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
            runs[f"{name}/seed={seed}"] = record
    return runs


def differences(old: object, new: object, path: str = "") -> list[str]:
    """Every leaf where ``old`` and ``new`` differ, as ``path: old -> new`` (wall time
    ignored; a field present on one side only counts as a difference)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(old.keys() | new.keys(), key=str):
            if key in WALL_FIELDS:
                continue
            where = f"{path}.{key}" if path else str(key)
            if key not in new:
                found.append(f"{where}: {old[key]!r} -> (missing)")
            elif key not in old:
                found.append(f"{where}: (missing) -> {new[key]!r}")
            else:
                found += differences(old[key], new[key], where)
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{path}[{i}]")
        ]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def compare(old_path: Path, new_path: Path) -> int:
    """Print every differing field per run; the number of runs that differ."""
    old = json.loads(old_path.read_text())["runs"]
    new = json.loads(new_path.read_text())["runs"]
    num_differing = 0
    for run in sorted(old.keys() | new.keys()):
        if run not in old or run not in new:
            print(f"{run}: only in {old_path if run in old else new_path}")
            num_differing += 1
            continue
        found = differences(old[run], new[run])
        print(f"{run}: {'equal' if not found else f'{len(found)} fields differ'}")
        for line in found:
            print(f"    {line}")
        num_differing += bool(found)
    print(f"{num_differing} of {len(old.keys() | new.keys())} runs differ")
    return num_differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="simulate every configuration; write the records")
    run.add_argument("--output", type=Path, required=True)
    run.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    diff = commands.add_parser("compare", help="every differing field of two record files")
    diff.add_argument("old", type=Path)
    diff.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.command == "compare":
        sys.exit(1 if compare(args.old, args.new) else 0)
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"}
        )
    tree = Path.cwd()
    runs = run_all(tree, args.only)
    document = {
        "trace": str(TRACE),
        "max_requests": MAX_REQUESTS,
        "base": BASE,
        "configs": {name: CONFIGS[name] for name in args.only},
        "runs": runs,
    }
    args.output.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
