"""Tables and plots of simulator records: one row per run, CDFs, sweep curves, replicates."""

import statistics
from collections import defaultdict
from collections.abc import Sequence

from benchmarks.report import Report, new_figure
from benchmarks.sim.peers import PEERS
from benchmarks.sim.simulator import STRATA

Record = dict[str, object]

METRICS = ("hit_rate", "best_replica_match", "ttft_p50_s", "ttft_p99_s", "load_imbalance")
POLICY_SOURCES = {
    STRATA: "Strata's router (router/): virtual prefix index fed by KV events, "
    "final = prefix_weight x prefix_score + load_weight x load_score (DESIGN section 6)",
    **{name: peer.source for name, peer in PEERS.items()},
}


_CATEGORICAL = ("write-back", "profile", "retention")  # sweep values that are not numbers


def label(record: Record) -> str:
    if record["policy"] == STRATA:
        return f"strata ({record['scoring_profile']})"
    return str(record["policy"])


def point(record: Record) -> str:
    """The sweep point of a record or summary row ("base" for the base configuration)."""
    return f"{record['sweep']}={record['sweep_value']}" if record["sweep"] else "base"


def run_rows(records: Sequence[Record]) -> list[list[object]]:
    return [
        [
            label(r),
            point(r),
            r["seed"],
            r["data_parallel_size"],
            r["num_npu_blocks"],
            r["num_host_blocks"],
            r["hit_rate"],
            r["npu_hit_rate"],
            r["host_hit_rate"],
            r.get("peer_hit_rate", 0.0),
            r["best_replica_match"],
            r["ttft_p50_s"],
            r["ttft_p99_s"],
            r["load_imbalance"],
            r["load_imbalance_at_arrivals"],
            r["throughput_rps"],
            r["num_skipped"],
        ]
        for r in records
    ]


RUN_HEADERS = [
    "policy",
    "point",
    "rep",
    "dp",
    "NPU blocks",
    "host blocks",
    "hit rate",
    "NPU hit",
    "host hit",
    "pulled",
    "chosen / best cached",
    "TTFT p50 (s)",
    "TTFT p99 (s)",
    "load imbalance",
    "imbalance @ arrivals",
    "req/s",
    "skipped",
]


def summarize(records: Sequence[Record]) -> list[Record]:
    """Mean and standard deviation over replicates of each (policy, sweep point)."""
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[(label(r), r["sweep"], r["sweep_value"])].append(r)
    out = []
    for (name, sweep, value), group in groups.items():
        row: Record = {"policy": name, "sweep": sweep, "sweep_value": value, "n": len(group)}
        for metric in METRICS:
            values = [float(g[metric]) for g in group]
            row[metric] = statistics.fmean(values)
            row[f"{metric}_sd"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        out.append(row)
    return out


def add_replicate_table(report: Report, records: Sequence[Record]) -> list[Record]:
    summary = summarize(records)
    rows = [
        [s["policy"], point(s), s["n"]] + [f"{s[m]:.3g} ± {s[m + '_sd']:.2g}" for m in METRICS]
        for s in summary
    ]
    report.add_table(
        "Mean ± standard deviation over replicates", ["policy", "point", "n", *METRICS], rows
    )
    return summary


def add_sources(report: Report, records: Sequence[Record]) -> None:
    used = sorted({str(r["policy"]) for r in records}, key=list(POLICY_SOURCES).index)
    rows = [[p, POLICY_SOURCES[p]] for p in used]
    report.add_table("Policies: sources and parameters", ["policy", "source"], rows)


def ttft_cdf_figure(report: Report, records: Sequence[Record], name: str = "ttft_cdf.png") -> None:
    base = [r for r in records if r["sweep"] is None and r["seed"] == 0]
    if not base:
        return
    figure, (axis,) = new_figure(1, width=7.0)
    for r in base:
        quantiles = r["ttft_quantiles_s"]
        axis.plot(quantiles, [q / 100 for q in range(len(quantiles))], label=label(r))
    axis.set_xscale("log")
    axis.set_xlabel("TTFT (s, log scale)")
    axis.set_ylabel("fraction of requests")
    axis.set_title(f"TTFT CDF, dp={base[0]['data_parallel_size']}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    report.figures[name] = figure


def sweep_figures(report: Report, records: Sequence[Record]) -> None:
    """One figure per swept parameter: hit rate, TTFT p50 and load imbalance vs its values
    (means over replicates), one line per policy."""
    summary = summarize(records)
    for kind in dict.fromkeys(s["sweep"] for s in summary if s["sweep"]):
        points = [s for s in summary if s["sweep"] == kind]
        values = list(dict.fromkeys(s["sweep_value"] for s in points))
        if len(values) < 2:
            continue  # one point is a table row, not a curve
        figure, axes = new_figure(3, width=5.0)
        for policy in dict.fromkeys(s["policy"] for s in points):
            mine = {s["sweep_value"]: s for s in points if s["policy"] == policy}
            xs = [v for v in values if v in mine]
            for axis, metric in zip(axes, ("hit_rate", "ttft_p50_s", "load_imbalance")):
                axis.errorbar(
                    range(len(xs)) if kind in _CATEGORICAL else [float(v) for v in xs],
                    [mine[v][metric] for v in xs],
                    yerr=[mine[v][metric + "_sd"] for v in xs],
                    marker="o",
                    capsize=3,
                    label=policy,
                )
        for axis, metric in zip(axes, ("hit rate", "TTFT p50 (s)", "load imbalance (max/mean)")):
            axis.set_xlabel(kind)
            axis.set_ylabel(metric)
            axis.grid(alpha=0.3)
            if kind in _CATEGORICAL:
                axis.set_xticks(range(len(values)), values)
            elif kind in ("dp", "npu-blocks"):
                axis.set_xscale("log", base=2)
                axis.set_xticks([float(v) for v in values], values)
        axes[1].set_yscale("log")
        axes[0].legend(fontsize=8)
        report.figures[f"hit_rate_vs_{kind}.png"] = figure
