"""``python -m benchmarks run SCENARIO [--output DIR] [--quick]``."""

import argparse
import inspect
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks import (
    agent_session,
    api_fields,
    cache_key,
    churn,
    churn_concurrent,
    churn_disk,
    churn_kv_dtype,
    cluster_cache,
    cluster_handover,
    curve_cost,
    decode,
    engine_vs_llamacpp,
    fidelity,
    gpu_engine,
    http_load,
    http_overhead,
    one_off,
    prefix_ttft,
    reload_vs_recompute,
    retention,
    routing,
    scaling,
    tenants,
    transfer,
)
from benchmarks.sim import (
    acceptance,
    cluster_cache_sim,
    router_micro,
    sim_vs_real,
    sweeps_scenario,
    tenants_sim,
)
from benchmarks.sim import calibrate as sim_calibrate
from benchmarks.sim import cli as sim_cli
from replicas.model.kv_format import KV_FORMATS

SCENARIOS = {
    module.NAME: module
    for module in (
        prefix_ttft,
        reload_vs_recompute,
        churn,
        churn_concurrent,
        churn_disk,
        churn_kv_dtype,
        one_off,
        curve_cost,
        transfer,
        routing,
        cache_key,
        http_load,
        http_overhead,
        router_micro,
        sim_vs_real,
        acceptance,
        sweeps_scenario,
        decode,
        engine_vs_llamacpp,
        gpu_engine,
        fidelity,
        cluster_cache,
        cluster_handover,
        cluster_cache_sim,
        api_fields,
        agent_session,
        scaling,
        tenants,
        tenants_sim,
        retention,
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
        help="torch intra-op threads (default: torch's choice, usually one per core; "
        "engine-vs-llamacpp: 2, for torch and llama.cpp)",
    )
    run.add_argument(
        "--model",
        default=None,
        help="model of the engine scenarios (prefix-ttft, reload-vs-recompute, churn, decode, "
        "engine-vs-llamacpp, tenants): a built-in or packaged name, a Hugging Face directory or "
        "a .gguf file (default: tiny; smollm2-135m for decode, engine-vs-llamacpp and tenants)",
    )
    run.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="device of the engine and transfer scenarios (reload-vs-recompute, transfer): "
        "auto is cuda when available (default: auto for engines, cpu for transfer)",
    )
    run.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        help="http-overhead: start the servers with --cpus-per-replica CPUS instead of their "
        "default sizing",
    )
    run.add_argument(
        "--dtype",
        nargs="+",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="dtypes the decode scenario measures (default: float32 and bfloat16); one dtype "
        "for reload-vs-recompute (default: float32); engine-vs-llamacpp measures each with "
        "each --quantization, auto only with auto (default: auto, float32, bfloat16)",
    )
    run.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=["auto", *KV_FORMATS],
        default=None,
        help="KV dtypes reload-vs-recompute and churn-kv-dtype measure side by side (default: "
        "auto, the engine dtype, and bfloat16, int8, fp8_e4m3)",
    )
    run.add_argument(
        "--quantization",
        nargs="+",
        choices=engine_vs_llamacpp.VARIANTS,
        default=None,
        help="Strata weight quantizations engine-vs-llamacpp measures (default: all)",
    )
    run.add_argument(
        "--decoder-stack",
        nargs="+",
        choices=["auto", "native", "eager"],
        default=None,
        help="engine-vs-llamacpp: Strata decoder stacks measured with each dtype and "
        "quantization (default: auto)",
    )
    run.add_argument(
        "--real-size",
        action="store_true",
        default=None,
        help="engine-vs-llamacpp: the rows for a real-size model (a 512-token cold prefill, a "
        "chunk after 1,000 and 4,000 cached tokens, decode at batch 1 and 32, 3 repetitions, "
        "8 perplexity windows, no speculative rows)",
    )
    run.add_argument(
        "--torch-compile",
        action="store_true",
        default=None,
        help="engine-vs-llamacpp: add rows for the default variant with --torch-compile "
        "against eager (compiling takes tens of seconds)",
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
    parser = build_parser()
    args = parser.parse_args(argv)
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
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    try:
        options = {name: _scenario_options(args, name) for name in names}
    except ValueError as error:
        parser.error(str(error))
    previous_threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        _run(args, options, shlex.join(["python", "-m", "benchmarks", *argv]))
    finally:
        torch.set_num_threads(previous_threads)
    return 0


def _scenario_options(args: argparse.Namespace, name: str) -> dict[str, object]:
    """The options given on the command line that scenario ``name``'s ``run`` takes; an option
    it does not take is an error when that scenario was asked for by name."""
    given = {
        "model": args.model,
        "dtypes": args.dtype,
        "device": args.device,
        "cpus_per_replica": args.cpus_per_replica,
        "quantizations": args.quantization,
        "decoder_stacks": args.decoder_stack,
        "kv_cache_dtypes": args.kv_cache_dtype,
        "threads": args.threads,  # also set for every scenario by main
        "torch_compile": args.torch_compile,
        "real_size": args.real_size,
    }
    accepted = inspect.signature(SCENARIOS[name].run).parameters
    options = {}
    for key, value in given.items():
        if value is None:
            continue
        if key in accepted:
            options[key] = value
        elif args.scenario != "all" and key != "threads":
            flag = _FLAGS.get(key, f"--{key.replace('_', '-')}")
            raise ValueError(f"{flag} does not apply to the {name} scenario")
    return options


_FLAGS = {  # options named otherwise
    "dtypes": "--dtype",
    "quantizations": "--quantization",
    "kv_cache_dtypes": "--kv-cache-dtype",
}


def _run(args: argparse.Namespace, options: dict[str, dict[str, object]], command: str) -> None:
    for name, scenario_options in options.items():
        if args.output is None:
            output_dir = DEFAULT_OUTPUT / name
        else:
            output_dir = args.output / name if args.scenario == "all" else args.output
        start = time.perf_counter()
        print(f"== {name}{' (quick)' * args.quick}, {torch.get_num_threads()} torch threads")
        SCENARIOS[name].run(output_dir, quick=args.quick, command=command, **scenario_options)
        print(f"== {name} took {time.perf_counter() - start:.1f} s")
