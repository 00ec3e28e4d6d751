"""churn-concurrent: the churn workload with many requests in flight, host tier vs NPU only.

The churn workload (``benchmarks.churn``: prefixes drawn with Zipf popularity, a working set
``num_prefixes / npu_tier_prefixes`` times the NPU tier, each prompt a prefix and a few fresh
tokens) served at each concurrency of ``concurrencies``: every request is submitted at once and
the engine runs at most that many (``max_num_seqs``), each decoding ``output_len`` tokens, as
an offline throughput run does. Three engines per concurrency, built fresh and run in turn:
``npu-only`` (prefix caching on the NPU tier alone), ``host`` (a host tier of
``host_memory_ratio`` x the NPU tier, the default write-through rule) and ``host+write-back``
(the same tier keeping every block the NPU tier evicts). Output tokens/s is every
output token over the run's wall time; TTFT counts from submission, so it includes the wait for
a running slot, which is what a host hit shortens (its prefill is a load). The target: host with
write-back over NPU only in output tokens/s at the highest concurrency (llm-d reports 2.9x for
its CPU tier, which keeps what the GPU evicts, at concurrency 128 on an H200). For the device:
``--model llama3-8b-shape --dtype bfloat16 --device cuda`` (``scripts/gpu-check.sh``).
"""

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.churn import Settings as ChurnSettings
from benchmarks.churn import churn_prompts
from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    build_llm,
    cache_counters,
    counters_delta,
    engine_options,
    fit_length,
    model_context_len,
    percentile,
    prompt_vocab,
    rotated,
)
from cluster import KVOffloadConfig
from replicas.sampling_params import SamplingParams

NAME = "churn-concurrent"
VARIANTS = ("npu-only", "host", "host+write-back")
HOST_OVER_NPU_TOKENS_TARGET = 2.5
TARGET_VARIANT = "host+write-back"  # every block the NPU tier evicts kept, as llm-d's CPU tier


@dataclass(frozen=True, slots=True)
class Settings:
    num_prefixes: int = 64
    prefix_len: int = 2048
    suffix_len: int = 8  # < one block: only prefix blocks are ever cached
    output_len: int = 64
    npu_tier_prefixes: int = 16  # the NPU tier: the working set / 4
    host_memory_ratio: float = 4.0  # host blocks per NPU block: the whole working set
    num_requests: int = 512
    concurrencies: tuple[int, ...] = (32, 128)
    zipf_s: float = 1.0
    seed: int = 0


QUICK = Settings(
    num_prefixes=12,
    prefix_len=64,
    output_len=4,
    npu_tier_prefixes=3,
    num_requests=24,
    concurrencies=(2, 4),
)


def _engine(settings: Settings, variant: str, concurrency: int, model: str, options: dict):
    host = None
    if variant != "npu-only":
        host = KVOffloadConfig(
            enabled=True,
            host_memory_ratio=settings.host_memory_ratio,
            write_back=variant == "host+write-back",
        )
    return build_llm(
        num_npu_blocks=settings.npu_tier_prefixes * settings.prefix_len // BLOCK_SIZE,
        max_model_len=settings.prefix_len + settings.suffix_len + settings.output_len + 8,
        offload=host,
        model=model,
        max_num_seqs=concurrency,
        **options,
    )


def _serve(llm, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Every prompt submitted at once; output tokens/s, TTFTs from submission, hit rates."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    before = cache_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = counters_delta(cache_counters(llm), before)
    llm.check_integrity()
    ttfts = [o.ttft_s for o in outputs]
    tokens = sum(len(o.token_ids) for o in outputs)
    queries = max(1, stats["queries"])
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "p90_ttft_s": percentile(ttfts, 90),
        "hit_rate": stats["hits"] / queries,
        "host_hit_rate": stats["host_hits"] / queries,
    }


def run(
    output_dir: Path,
    *,
    quick: bool,
    command: str,
    model: str = DEFAULT_MODEL,
    device: str | None = None,
    dtypes: list[str] | None = None,
) -> dict[str, object]:
    """``device``: where the engines run (default: the engine's ``auto``); ``dtypes``: one
    weights dtype (default: the engine's)."""
    options = engine_options(NAME, device, dtypes)
    settings = QUICK if quick else Settings()
    limit = model_context_len(model) - settings.suffix_len - settings.output_len - 8
    settings = replace(settings, prefix_len=fit_length(settings.prefix_len, limit))
    churn = ChurnSettings(
        num_prefixes=settings.num_prefixes,
        prefix_len=settings.prefix_len,
        suffix_len=settings.suffix_len,
        num_requests=settings.num_requests,
        zipf_s=settings.zipf_s,
        seed=settings.seed,
    )
    levels, prompts = [], None
    for turn, concurrency in enumerate(settings.concurrencies):
        level: dict[str, object] = {"concurrency": concurrency}
        for variant in rotated(VARIANTS, turn):  # no configuration always runs first
            llm = _engine(settings, variant, concurrency, model, options)
            try:
                if prompts is None:  # one sequence for every engine (one model, one vocab)
                    _, prompts = churn_prompts(churn, prompt_vocab(llm))
                level[variant] = _serve(llm, prompts, settings.output_len)
            finally:
                llm.shutdown()
            print(f"{NAME} concurrency {concurrency} {variant}: {level[variant]}", flush=True)
        npu = level["npu-only"]
        keys = ("output_tokens_per_s", "mean_ttft_s")
        level["over_npu_only"] = {
            name: {key: level[name][key] / npu[key] for key in keys} for name in VARIANTS[1:]
        }
        levels.append(level)
    return _report(settings, levels, model, command, quick).write(output_dir)


def _report(settings: Settings, levels: list, model: str, command: str, quick: bool) -> Report:
    top = levels[-1]["over_npu_only"][TARGET_VARIANT]["output_tokens_per_s"]
    report = Report(
        NAME,
        f"Churn at concurrency {', '.join(map(str, settings.concurrencies))}: "
        f"{settings.num_prefixes} prefixes of {settings.prefix_len} tokens, working set "
        f"{settings.num_prefixes / settings.npu_tier_prefixes:g}x the NPU tier, model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        f"{settings.num_requests} requests, {settings.output_len} output tokens each",
        ["concurrency", "config", "output tok/s", "mean TTFT (ms)", "p90 TTFT (ms)", "hit rate",
         "host hits"],
        [
            [level["concurrency"], name, r["output_tokens_per_s"], 1e3 * r["mean_ttft_s"],
             1e3 * r["p90_ttft_s"], r["hit_rate"], r["host_hit_rate"]]
            for level in levels
            for name, r in ((n, level[n]) for n in VARIANTS)
        ],
    )  # fmt: skip
    report.add_table(
        f"Over NPU only (target: {TARGET_VARIANT} output tok/s >= {HOST_OVER_NPU_TOKENS_TARGET}"
        f" at concurrency {levels[-1]['concurrency']})",
        ["concurrency", "config", "output tok/s", "mean TTFT"],
        [
            [level["concurrency"], name, *ratios.values()]
            for level in levels
            for name, ratios in level["over_npu_only"].items()
        ],
    )
    report.figures["churn-concurrent.png"] = _plot(levels)
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "levels": levels,
        "target_met": top >= HOST_OVER_NPU_TOKENS_TARGET,
    }
    return report


def _plot(levels: list):
    """Output tokens/s and mean TTFT per concurrency, one bar per configuration."""
    figure, (left, right) = new_figure(2)
    names = [str(level["concurrency"]) for level in levels]
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        at = [k + width * i for k in range(len(levels))]
        left.bar(at, [lv[variant]["output_tokens_per_s"] for lv in levels], width, label=variant)
        right.bar(at, [1e3 * lv[variant]["mean_ttft_s"] for lv in levels], width, label=variant)
    middle = width * (len(VARIANTS) - 1) / 2
    for axes, label in ((left, "output tokens/s"), (right, "mean TTFT (ms)")):
        axes.set_xticks([k + middle for k in range(len(levels))], names)
        axes.set_xlabel("concurrency (max_num_seqs)")
        axes.set_ylabel(label)
        axes.legend()
    return figure
