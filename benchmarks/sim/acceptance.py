"""sim-acceptance: Strata's scoring policy vs every peer on the shipped trace at dp 8.

Criteria, for Strata's ``scoring`` policy with the balanced profile: a hit rate at least as high
as every peer's, a load imbalance of at most 1.3 and a p50 TTFT no worse than the best peer's.
They are judged on the trace as recorded (replicate 0) and on the means over 12 replicates
(replicate k > 0: arrivals jittered by up to 10 ms, peers' random tie-breaks seeded with k),
because one interleaving moves the figures (benchmarks/README.md gives the spread); for the
means, the difference to the best peer is given with its standard error. The same
comparison with arrivals twice as fast (a loaded cluster) is reported, not judged. Sizes: see
``benchmarks/sim/scenarios.py``.
"""

import statistics
from pathlib import Path

from benchmarks.report import Report
from benchmarks.sim import report as sim_report
from benchmarks.sim import scenarios
from benchmarks.sim.runs import Sweep
from benchmarks.sim.simulator import STRATA

NAME = "sim-acceptance"
MAX_IMBALANCE = 1.3


def verdicts(records: list[dict[str, object]]) -> list[dict[str, object]]:
    """The three criteria on replicate 0 and on replicate means, at the base point."""
    base = [r for r in records if r["sweep"] is None]
    out = []
    for basis, rows in (("replicate 0", [r for r in base if r["seed"] == 0]), ("mean", base)):
        by_policy: dict[str, dict[str, float]] = {}
        for policy in dict.fromkeys(str(r["policy"]) for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            by_policy[policy] = {"n": len(mine)}
            for m in sim_report.METRICS:
                values = [float(r[m]) for r in mine]
                by_policy[policy][m] = statistics.fmean(values)
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                by_policy[policy][m + "_se"] = sd / len(values) ** 0.5
        strata = by_policy.pop(STRATA)
        best_hit = max(by_policy, key=lambda p: by_policy[p]["hit_rate"])
        best_p50 = min(by_policy, key=lambda p: by_policy[p]["ttft_p50_s"])
        checks = [
            (
                "hit rate >= every peer",
                "hit_rate",
                best_hit,
                strata["hit_rate"] >= by_policy[best_hit]["hit_rate"],
            ),
            (
                f"load imbalance <= {MAX_IMBALANCE}",
                "load_imbalance",
                None,
                strata["load_imbalance"] <= MAX_IMBALANCE,
            ),
            (
                "TTFT p50 <= best peer",
                "ttft_p50_s",
                best_p50,
                strata["ttft_p50_s"] <= by_policy[best_p50]["ttft_p50_s"],
            ),
        ]
        for criterion, metric, peer, passed in checks:
            other = by_policy[peer] if peer else None
            difference = se = None
            if other is not None:
                difference = strata[metric] - other[metric]
                if basis == "mean":
                    se = (strata[metric + "_se"] ** 2 + other[metric + "_se"] ** 2) ** 0.5
            out.append(
                {
                    "basis": basis,
                    "criterion": criterion,
                    "strata": strata[metric],
                    "peer": peer or "",
                    "peer_value": other[metric] if other else None,
                    "difference": difference,
                    "difference_se": se,
                    "pass": passed,
                }
            )
    return out


def _cell(value: float | None) -> object:
    return "" if value is None else value


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    replicates = 2 if quick else 12
    results, trace = scenarios.simulate([Sweep("speedup", ("2",))], replicates, quick)
    report = Report(
        NAME,
        "Acceptance: Strata's scoring vs peer routing policies (simulated, dp 8)",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip() + "\n\n" + scenarios.__doc__.split("\n\n")[1].strip(),
    )
    checks = verdicts(results)
    report.add_table(
        "Verdict (base point: arrivals as recorded)",
        ["basis", "criterion", "strata", "best peer", "peer value", "difference", "± se", "pass"],
        [
            [c["basis"], c["criterion"], c["strata"], c["peer"]]
            + [_cell(c[k]) for k in ("peer_value", "difference", "difference_se")]
            + [c["pass"]]
            for c in checks
        ],
    )
    summary = sim_report.add_replicate_table(report, results)
    report.results = {"verdicts": checks, "replicate_summary": summary}
    return scenarios.write(report, results, trace, output_dir)
