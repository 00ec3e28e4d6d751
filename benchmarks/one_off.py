"""one-off: prefixes that are never requested again once the NPU tier has evicted them, plus a
few hot ones.

Each one-off prefix is requested twice in a row (its second request hits the NPU tier) and never
again; between them, hot prefixes recur. Write-back stores every evicted block to host for
nothing; the default policy stores only what reaches 2 hits (the hot prefixes); the adaptive
policy should learn that blocks evicted after one hit never return and stop storing them. Four
engines (NPU only, host tier with the default policy, with write-back, with adaptive retention)
serve the identical sequence one request at a time, taking turns in a rotating order.
"""

import random
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from benchmarks.churn import build_engines, fit_prefix, serve_in_turns
from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    DEFAULT_MODEL,
    prompt_vocab,
    random_tokens,
)

NAME = "one-off"
VARIANTS = ("npu-only", "host", "host+write-back", "host+adaptive")
STORED_OVER_WRITE_BACK_TARGET = 0.1
ADAPTIVE_OVER_DEFAULT_MEAN_TARGET = 1.05


@dataclass(frozen=True, slots=True)
class Settings:
    num_hot: int = 2  # prefixes that keep coming back
    hot_share: float = 0.25  # of requests
    prefix_len: int = 1024
    suffix_len: int = 8
    npu_tier_prefixes: int = 4
    host_memory_ratio: float = 4.0
    num_requests: int = 320
    seed: int = 0


QUICK = Settings(prefix_len=256, npu_tier_prefixes=3, num_requests=40)


def one_off_sequence(settings: Settings, rng: random.Random) -> list[int]:
    """Prefix index of each request: ``0 .. num_hot - 1`` are hot, every later index is a one-off
    prefix requested twice in a row and never again."""
    sequence: list[int] = []
    next_one_off = settings.num_hot
    while len(sequence) < settings.num_requests:
        if rng.random() < settings.hot_share:
            sequence.append(rng.randrange(settings.num_hot))
        else:
            sequence += [next_one_off, next_one_off]
            next_one_off += 1
    return sequence[: settings.num_requests]


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = DEFAULT_MODEL
) -> dict[str, object]:
    settings = fit_prefix(QUICK if quick else Settings(), model)
    llms = build_engines(
        npu_tier_prefixes=settings.npu_tier_prefixes,
        prefix_len=settings.prefix_len,
        suffix_len=settings.suffix_len,
        host_memory_ratio=settings.host_memory_ratio,
        model=model,
        names=VARIANTS,
    )
    vocab = prompt_vocab(next(iter(llms.values())))
    rng = random.Random(settings.seed)
    sequence = one_off_sequence(settings, rng)
    prefixes = [random_tokens(rng, settings.prefix_len, vocab) for _ in range(max(sequence) + 1)]
    prompts = [
        prefixes[prefix] + random_tokens(rng, settings.suffix_len, vocab) for prefix in sequence
    ]
    configs, _ = serve_in_turns(llms, prompts)

    stored = {name: c["counters"]["blocks_stored"] for name, c in configs.items()}
    mean = {name: c["mean_ttft_s"] for name, c in configs.items()}
    ratios = {
        "adaptive_stored_over_write_back": stored["host+adaptive"]
        / max(1, stored["host+write-back"]),
        "adaptive_mean_ttft_over_default": mean["host+adaptive"] / mean["host"],
        "write_back_mean_ttft_over_default": mean["host+write-back"] / mean["host"],
        "default_mean_ttft_over_npu_only": mean["host"] / mean["npu-only"],
    }
    targets = {
        "adaptive stored blocks / write-back's": (
            ratios["adaptive_stored_over_write_back"],
            STORED_OVER_WRITE_BACK_TARGET,
        ),
        "adaptive mean TTFT / default's": (
            ratios["adaptive_mean_ttft_over_default"],
            ADAPTIVE_OVER_DEFAULT_MEAN_TARGET,
        ),
    }
    target_met = all(value <= bound for value, bound in targets.values())

    prompt_len = settings.prefix_len + settings.suffix_len
    report = Report(
        NAME,
        f"One-off prefixes: {max(sequence) + 1 - settings.num_hot} used twice then never again, "
        f"{settings.num_hot} hot ({settings.hot_share:.0%} of requests), NPU tier = "
        f"{settings.npu_tier_prefixes} prefixes, model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    counters = ["npu_evictions", "write_through_promotions", "write_backs", "blocks_stored"]
    report.add_table(
        f"{settings.num_requests} sequential requests of {prompt_len} tokens",
        ["config", "mean TTFT (ms)", "p50 (ms)", "hit rate", "host hits", *counters],
        [
            [name, 1e3 * c["mean_ttft_s"], 1e3 * c["p50_ttft_s"], c["hit_rate"]]
            + [c["host_hit_rate"], *(c["counters"][k] for k in counters)]
            for name, c in configs.items()
        ],
    )
    report.add_table(
        "Targets",
        ["ratio", "value", "target", "met"],
        [
            [name, value, f"<= {bound}", "pass" if value <= bound else "FAIL"]
            for name, (value, bound) in targets.items()
        ],
    )
    report.figures["one_off.png"] = _plot(configs)
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "configs": configs,
        "ratios": ratios,
        "target_met": target_met,
    }
    return report.write(output_dir)


def _plot(configs: dict[str, dict]) -> Figure:
    figure, (left, right) = new_figure(2)
    names = list(configs)
    left.bar(names, [configs[n]["counters"]["blocks_stored"] for n in names])
    left.set_ylabel("blocks stored to host")
    left.set_title("host stores")
    right.bar(names, [1e3 * configs[n]["mean_ttft_s"] for n in names])
    right.set_ylabel("mean TTFT (ms)")
    right.set_title("mean TTFT")
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=20)
    return figure
