"""``python -m benchmarks simulate``: replay a trace through simulated replicas and routers.

Writes ``report.md``, ``results.json`` (one record per run) and PNG plots to ``--output``.
"""

import argparse
from pathlib import Path

from benchmarks.report import Report
from benchmarks.sim import report as sim_report
from benchmarks.sim.cost_model import KV_CACHE_DTYPES, CostModel, HardwareProfile
from benchmarks.sim.metrics import ideal_ttft_s, ttft_figures
from benchmarks.sim.peer_tier import MEASURED, PEER_PULL_MIN_BLOCKS
from benchmarks.sim.peers import PEERS
from benchmarks.sim.runs import execute, parse_sweep, plan_runs, write_through_threshold
from benchmarks.sim.simulator import CLAIRVOYANT, STRATA, SimConfig
from benchmarks.sim.trace import (
    TRACE_TOKENS_PER_HASH_ID,
    TraceRecord,
    expand,
    load_trace,
    trace_summary,
)

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "synthetic_trace.jsonl"
POLICIES = [STRATA, *PEERS]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="Mooncake-format JSON lines trace (default benchmarks/traces/synthetic_trace.jsonl)",
    )
    add("--output", type=Path, required=True, help="report folder")
    add("--data-parallel-size", "-dp", type=int, default=8, help="replicas (default 8)")
    add(
        "--policy",
        nargs="+",
        default=["all"],
        choices=[*POLICIES, "all"],
        metavar="NAME",
        help=f"routing policies: {', '.join(POLICIES)} or all (default all)",
    )
    add(
        "--profile",
        nargs="+",
        default=["balanced"],
        choices=["balanced", "locality", "load", "ttft"],
        help="Strata's scoring profile(s) (default balanced); ttft prices each replica with "
        "the hardware profile's costs",
    )
    add(
        "--hardware",
        default="h200-llama8b",
        help="hardware profile: a name in benchmarks/sim/profiles or a JSON path",
    )
    add(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="KV dtype the hardware profile simulates: its bytes per token size the tiers in "
        "blocks and the copy times (default: the profile's kv_cache_dtype, auto)",
    )
    add(
        "--num-npu-blocks",
        type=int,
        default=None,
        help="NPU blocks per replica (default: what the profile's KV memory holds)",
    )
    host = parser.add_mutually_exclusive_group()
    host.add_argument(
        "--host-memory-gb",
        type=float,
        default=0.0,
        help="process-wide host KV budget in GiB, split among replicas",
    )
    host.add_argument(
        "--host-memory-ratio",
        type=float,
        default=0.0,
        help="host blocks per NPU block, per replica",
    )
    add(
        "--disk-memory-gb",
        type=float,
        default=0.0,
        help="process-wide disk KV tier in GiB behind the host tier, split among replicas, "
        "all on one node (needs a host tier and the profile's disk bandwidth)",
    )
    add(
        "--write-through-threshold",
        type=write_through_threshold,
        default=2,
        help="hits that promote a block to host; 0 disables, 'immediate' at first write "
        "(default 2)",
    )
    add("--write-back", action="store_true", help="store evicted NPU-only blocks to host")
    add(
        "--retention",
        choices=("fixed", "adaptive", CLAIRVOYANT),
        default="fixed",
        help="host retention policy (KVOffloadConfig.retention; default fixed); adaptive "
        "excludes --write-back; clairvoyant is a bound that reads the trace's future: it stores "
        "a block the NPU tier evicts when it is requested again within --clairvoyant-window-s",
    )
    add(
        "--clairvoyant-window-s",
        type=float,
        default=300.0,
        help="with --retention clairvoyant: store blocks requested again this soon (default 300)",
    )
    add(
        "--reservation-share",
        type=float,
        default=0.0,
        help="share of NPU blocks waiting requests' prefixes may hold and prefetch into "
        "(PrefixCacheConfig.reservation_share; default 0: off)",
    )
    add(
        "--ttft-slack",
        type=float,
        default=0.0,
        help="the ttft profile's slack (TTFTCosts.slack; default 0: the lowest predicted TTFT)",
    )
    add(
        "--ttft-forfeit-weight",
        type=float,
        default=0.0,
        help="the ttft profile's forfeit weight (TTFTCosts.forfeit_weight; default 0)",
    )
    add_peer_arguments(parser)
    add("--block-size", type=int, default=16)
    add(
        "--sliding-window",
        type=int,
        default=None,
        help="simulate a hybrid model: global layers and layers attending to this many "
        "simulated tokens, each with its own cache type (default: global attention only)",
    )
    add(
        "--sliding-layer-fraction",
        type=float,
        default=0.5,
        help="with --sliding-window: the share of KV bytes in the sliding layers (default 0.5)",
    )
    add(
        "--tokens-per-hash-id",
        type=int,
        default=16,
        help="tokens per trace hash id, a multiple of the block size (default 16)",
    )
    add(
        "--token-scale",
        type=float,
        default=None,
        help="trace tokens per simulated token for the cost model (default 512 / T)",
    )
    add("--max-requests", type=int, default=None, help="replay only the first K requests")
    add(
        "--arrival-speedup",
        type=float,
        default=1.0,
        help="divide the trace's timestamps by this (default 1: as recorded)",
    )
    add("--event-delay-ms", type=float, default=1.0, help="replica -> router report delay")
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048, help="per step, simulated tokens")
    add(
        "--replicates",
        type=int,
        default=1,
        help="runs per point; replicate k > 0 jitters arrivals and reseeds peers' ties",
    )
    add(
        "--sweep",
        action="append",
        default=[],
        metavar="KIND[=V1,V2,...]",
        help="dp=, host-gb=, host-ratio=, threshold=, write-back, npu-blocks=, speedup=, "
        "profile, retention, reservation=, prefetch (reservations without or with prefetch), "
        "overload= (routing.overload_factor; default 0,16) "
        "(repeatable; one parameter at a time)",
    )
    add("--jobs", type=int, default=1, help="worker processes (default 1)")
    add("--quiet", action="store_true", help="no progress bars")


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The peer tier's options (``SimConfig.peer_pull*``)."""
    add = parser.add_argument
    add(
        "--peer-pull",
        action="store_true",
        help="the peer tier: replicas pull the prefix blocks Strata's router names a source for "
        "when the cost rule says pulling beats computing (needs a host tier; sim/peer_tier.py)",
    )
    add(
        "--peer-pull-fixed-s",
        type=float,
        default=MEASURED.fixed_s,
        help=f"with --peer-pull: a pull's fixed cost (default {MEASURED.fixed_s:.3f} s, fit to "
        "the cluster-cache benchmark)",
    )
    add(
        "--peer-pull-gbps",
        type=float,
        default=MEASURED.bytes_per_s / 1e9,
        help="with --peer-pull: GB/s a pull moves KV bytes at (default "
        f"{MEASURED.bytes_per_s / 1e9:.3f}, fit to the cluster-cache benchmark)",
    )
    add(
        "--peer-pull-min-blocks",
        type=int,
        default=PEER_PULL_MIN_BLOCKS,
        help="with --peer-pull: the router names a source holding at least this many more "
        f"blocks (routing.peer_pull_min_blocks, default {PEER_PULL_MIN_BLOCKS})",
    )


def base_config(args: argparse.Namespace) -> SimConfig:
    if args.tokens_per_hash_id % args.block_size:
        raise SystemExit(
            f"--tokens-per-hash-id {args.tokens_per_hash_id} must be a multiple of "
            f"--block-size {args.block_size}"
        )
    if args.retention != "fixed" and args.write_back:
        raise SystemExit(
            f"--retention {args.retention} decides write-back per block; drop --write-back"
        )
    if args.clairvoyant_window_s <= 0:
        raise SystemExit(
            f"--clairvoyant-window-s must be positive, got {args.clairvoyant_window_s}"
        )
    if args.sliding_window is not None and args.sliding_window < 1:
        raise SystemExit(
            f"--sliding-window must be a positive token count, got {args.sliding_window}"
        )
    if not 0 < args.sliding_layer_fraction < 1:
        raise SystemExit(
            f"--sliding-layer-fraction must be between 0 and 1, got {args.sliding_layer_fraction}"
        )
    if args.peer_pull and not (args.host_memory_gb or args.host_memory_ratio):
        raise SystemExit("--peer-pull needs a host tier: pulled blocks load through it")
    token_scale = args.token_scale or TRACE_TOKENS_PER_HASH_ID / args.tokens_per_hash_id
    return SimConfig(
        data_parallel_size=args.data_parallel_size,
        block_size=args.block_size,
        tokens_per_hash_id=args.tokens_per_hash_id,
        num_npu_blocks=args.num_npu_blocks,
        host_memory_gb=args.host_memory_gb,
        host_memory_ratio=args.host_memory_ratio,
        disk_memory_gb=args.disk_memory_gb,
        write_through_threshold=args.write_through_threshold,
        write_back=args.write_back,
        retention=args.retention,
        clairvoyant_window_s=args.clairvoyant_window_s,
        reservation_share=args.reservation_share,
        ttft_slack=args.ttft_slack,
        ttft_forfeit_weight=args.ttft_forfeit_weight,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        event_delay_s=args.event_delay_ms / 1000,
        token_scale=token_scale,
        arrival_speedup=args.arrival_speedup,
        sliding_window=args.sliding_window,
        sliding_layer_fraction=args.sliding_layer_fraction,
        peer_pull=args.peer_pull,
        peer_pull_fixed_s=args.peer_pull_fixed_s,
        peer_pull_bytes_per_s=args.peer_pull_gbps * 1e9,
        peer_pull_min_blocks=args.peer_pull_min_blocks,
    )


def run(args: argparse.Namespace, command: str) -> dict[str, object]:
    """Plan, run and report every simulation the arguments ask for."""
    try:
        sweeps = [parse_sweep(spec) for spec in args.sweep]
        profile = HardwareProfile.load(args.hardware)
        if args.kv_cache_dtype is not None:
            profile = profile.with_kv_cache_dtype(args.kv_cache_dtype)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    base = base_config(args)
    policies = POLICIES if "all" in args.policy else list(dict.fromkeys(args.policy))
    records = load_trace(args.trace, args.max_requests)
    requests = expand(records, args.tokens_per_hash_id)
    runs = plan_runs(base, policies, args.profile, sweeps, max(1, args.replicates))
    print(f"{len(requests)} requests from {args.trace}, {len(runs)} runs", flush=True)
    results = execute(runs, requests, profile, jobs=args.jobs, progress=not args.quiet)
    report = build_report(command, args, records, profile, results)
    return report.write(args.output)


def build_report(
    command: str,
    args: argparse.Namespace,
    records: list[TraceRecord],
    profile: HardwareProfile,
    results: list[dict[str, object]],
) -> Report:
    summary = trace_summary(records)
    first = results[0]
    report = Report(
        "simulate",
        f"Trace-driven simulation: {args.trace.name}",
        command,
        False,
        (
            f"{summary['num_requests']} requests over {summary['duration_s']:.0f} s replayed "
            f"through simulated replicas (real scheduler, KV cache manager and router code; "
            f"hardware profile `{profile.name}`, KV dtype {profile.kv_cache_dtype}: "
            f"{profile.kv_cache_bytes_per_token} bytes per token). One hash id = "
            f"{args.tokens_per_hash_id} tokens; each simulated token stands for "
            f"{first['token_scale']:g} trace tokens in the cost model. An unbounded prefix "
            f"cache would serve {summary['unbounded_prefix_hit_rate']:.3f} of the blocks. "
            "Load imbalance = max / mean over replicas of each replica's time-averaged "
            "outstanding tokens; "
            "'@ arrivals' = mean over arrivals of the instantaneous max / mean "
            "(see benchmarks/sim/metrics.py)."
        ),
    )
    report.add_table("Runs", sim_report.RUN_HEADERS, sim_report.run_rows(results))
    cost_model = CostModel(profile, args.block_size, first["token_scale"])
    ideal = ttft_figures(ideal_ttft_s(records, cost_model, args.tokens_per_hash_id))
    report.sections.append(
        f"**Ideal bound** (no queueing, an unbounded prefix cache: `metrics.ideal_ttft_s`): "
        f"TTFT p50 {ideal['ttft_p50_s']:.3g} s, p99 {ideal['ttft_p99_s']:.3g} s. No routing "
        "policy can go below it; a policy's TTFT over it is queueing plus the prefixes its "
        "cache lost."
    )
    summary_rows = None
    if any(r["seed"] for r in results):
        summary_rows = sim_report.add_replicate_table(report, results)
    sim_report.add_sources(report, results)
    sim_report.ttft_cdf_figure(report, results)
    sim_report.sweep_figures(report, results)
    report.results = {
        "trace": {"path": str(args.trace), **summary},
        "hardware_profile": profile.name,
        "kv_cache_dtype": profile.kv_cache_dtype,
        "records": results,
        "ideal": {k: v for k, v in ideal.items() if k != "ttft_quantiles_s"},
        "replicate_summary": summary_rows,
        "policy_sources": sim_report.POLICY_SOURCES,
    }
    return report
