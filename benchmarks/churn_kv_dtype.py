"""churn-kv-dtype: the churn workload at one fixed host budget in bytes, by KV dtype.

Each request is one of ``num_prefixes`` prefixes (Zipf(``zipf_s``) popularity) plus a few fresh
tokens. One engine per KV dtype (``kv_cache_dtype``: by default the engine dtype, bfloat16, int8
and fp8_e4m3), all with the same NPU tier in blocks (``npu_tier_prefixes`` prefixes) and the
same host budget in bytes (``host_memory_bytes``: ``host_bf16_prefixes`` prefixes' worth of
bfloat16 KV), so a narrower KV holds more host blocks in the same bytes. The working set is
sized to fit the int8 host tier but not the bfloat16 one. Every engine writes back (a block the
NPU tier evicts goes to host), so the host tier keeps as many prefixes as its blocks hold. The
engines serve the identical sequence one request at a time, taking turns request by request
(the order rotates). A *host hit* is a request whose prefix came, in part or whole, from the
host tier; its *load copy* is the transfer component's time while it ran.
"""

from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from benchmarks.churn import churn_prompts, fit_prefix, summary, unbounded_hit_rate
from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    build_llm,
    cache_counters,
    counters_delta,
    kv_block_bytes,
    prompt_vocab,
    rotated,
    timed_request,
)
from cluster import LLM, KVOffloadConfig
from replicas.kv.events import Tier

NAME = "churn-kv-dtype"
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8_e4m3")  # auto: the engine dtype
REFERENCE = "bfloat16"  # the targets compare int8 with bfloat16 KV
TARGETS = {  # int8 over bfloat16, at one host budget: (ratio, bound, at least or at most)
    "host blocks": ("host_blocks", 1.9, ">="),
    "mean TTFT": ("mean_ttft_s", 0.75, "<="),
    "host-hit TTFT": ("host_hit_mean_ttft_s", 0.7, "<="),
}


@dataclass(frozen=True, slots=True)
class Settings:
    num_prefixes: int = 56  # working set: 3584 blocks
    prefix_len: int = 1024
    suffix_len: int = 8  # < one block: only prefix blocks are ever cached
    npu_tier_prefixes: int = 8
    host_bf16_prefixes: int = 32  # the host budget: 32 prefixes of bfloat16 KV (64 MiB on tiny)
    num_requests: int = 800
    zipf_s: float = 1.0
    seed: int = 0


QUICK = Settings(
    num_prefixes=14, prefix_len=256, npu_tier_prefixes=2, host_bf16_prefixes=8, num_requests=48
)


def host_budget_bytes(settings: Settings, model: str) -> int:
    """The one host budget of every engine: ``host_bf16_prefixes`` prefixes of bfloat16 KV."""
    blocks = settings.host_bf16_prefixes * settings.prefix_len // BLOCK_SIZE
    return blocks * kv_block_bytes(model, "bfloat16", "bfloat16")


def build_engines(
    settings: Settings, model: str, kv_cache_dtypes: tuple[str, ...], host_bytes: int
) -> dict[str, LLM]:
    """One write-back engine per KV dtype, equal NPU blocks and equal host bytes; an option that
    resolves to the KV dtype of an engine already built (``auto``, the engine dtype) is
    dropped."""
    llms: dict[str, LLM] = {}
    for name in kv_cache_dtypes:
        llm = build_llm(
            num_npu_blocks=settings.npu_tier_prefixes * settings.prefix_len // BLOCK_SIZE,
            max_model_len=settings.prefix_len + settings.suffix_len + 8,
            model=model,
            kv_cache_dtype=name,
            offload=KVOffloadConfig(
                enabled=True,
                host_memory_bytes=host_bytes,
                write_through_threshold=2,
                write_back=True,
            ),
        )
        resolved = llm.engine.config.kv_cache_dtype
        if any(other.engine.config.kv_cache_dtype == resolved for other in llms.values()):
            llm.shutdown()
            continue
        llms[name] = llm
    return llms


@dataclass(slots=True)
class Served:
    """One engine's requests: TTFT, host-tier tokens and load-copy seconds of each."""

    ttft_s: list[float]
    host_tokens: list[int]
    copy_s: list[float]


def serve_in_turns(llms: dict[str, LLM], prompts: list[list[int]]) -> dict[str, Served]:
    """Every prompt through every engine, one at a time, the engines taking turns in a rotating
    order."""
    served = {name: Served([], [], []) for name in llms}
    for i, prompt in enumerate(prompts):
        for name in rotated(list(llms), i):
            transfer = llms[name].engine.transfer
            before = transfer.stats.seconds
            output = timed_request(llms[name], prompt)
            served[name].ttft_s.append(output.ttft_s)
            served[name].host_tokens.append(output.num_cached_tokens_in(Tier.HOST))
            served[name].copy_s.append(transfer.stats.seconds - before)
        if (i + 1) % max(1, len(prompts) // 10) == 0:
            print(f"{i + 1}/{len(prompts)} requests", flush=True)
    return served


def engine_summary(llm: LLM, served: Served, counters: dict[str, int]) -> dict[str, object]:
    """``churn.summary`` plus the KV dtype's blocks and bytes and the host hits' figures."""
    stats = llm.stats()
    tiers = stats.cache_types["full"].tiers
    host = [i for i, tokens in enumerate(served.host_tokens) if tokens]
    return {
        **summary(served.ttft_s, counters),
        "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
        "block_bytes": stats.transfer.bytes_loaded // max(1, stats.transfer.blocks_loaded),
        "npu_blocks": tiers[Tier.NPU].num_blocks,
        "host_blocks": tiers[Tier.HOST].num_blocks,
        "num_host_hits": len(host),
        "host_hit_mean_ttft_s": _mean([served.ttft_s[i] for i in host]),
        "host_hit_mean_copy_s": _mean([served.copy_s[i] for i in host]),
        "host_hit_mean_host_tokens": _mean([served.host_tokens[i] for i in host]),
        "counters": counters,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run(
    output_dir: Path,
    *,
    quick: bool,
    command: str,
    model: str = DEFAULT_MODEL,
    kv_cache_dtypes: tuple[str, ...] | None = None,
) -> dict[str, object]:
    """``kv_cache_dtypes``: the KV dtypes served side by side (default ``KV_CACHE_DTYPES``)."""
    settings = fit_prefix(QUICK if quick else Settings(), model)
    host_bytes = host_budget_bytes(settings, model)
    names = tuple(dict.fromkeys(kv_cache_dtypes or KV_CACHE_DTYPES))
    llms = build_engines(settings, model, names, host_bytes)
    vocab = prompt_vocab(next(iter(llms.values())))
    sequence, prompts = churn_prompts(settings, vocab)
    prompt_len = settings.prefix_len + settings.suffix_len
    before = {name: cache_counters(llm) for name, llm in llms.items()}
    served = serve_in_turns(llms, prompts)
    configs = {}
    for name, llm in llms.items():
        llm.check_integrity()
        counters = counters_delta(cache_counters(llm), before[name])
        configs[name] = engine_summary(llm, served[name], counters)
        llm.shutdown()
    unbounded = unbounded_hit_rate(sequence, settings.prefix_len, prompt_len)
    ratios = _ratios(configs, served)
    targets = _targets(ratios)

    working_set_blocks = settings.num_prefixes * settings.prefix_len // BLOCK_SIZE
    labels = {name: _label(name, c["kv_cache_dtype"]) for name, c in configs.items()}
    report = Report(
        NAME,
        f"Churn by KV dtype: {settings.num_prefixes} prefixes of {settings.prefix_len} tokens "
        f"({working_set_blocks} blocks), Zipf {settings.zipf_s}, host budget "
        f"{host_bytes / 2**30:.4g} GiB, model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    _add_tables(report, settings, configs, labels, ratios, targets, unbounded, host_bytes)
    report.figures["churn_kv_dtype.png"] = _plot(configs, labels, served, unbounded)
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "host_memory_bytes": host_bytes,
        "working_set_blocks": working_set_blocks,
        "unbounded_hit_rate": unbounded,
        "compulsory_miss_fraction": len(set(sequence)) / len(sequence),
        "configs": configs,
        "ratios": ratios,
        "targets": targets,
        "ttft_s": {name: s.ttft_s for name, s in served.items()},
        "host_tokens": {name: s.host_tokens for name, s in served.items()},
    }
    return report.write(output_dir)


def _ratios(configs: dict[str, dict], served: dict[str, Served]) -> dict[str, dict[str, float]]:
    """Each KV dtype's figures over bfloat16 KV's (when bfloat16 was served). ``paired_*``: over
    the requests both served as host hits of equally many host tokens, the same reloads."""
    if REFERENCE not in configs:
        return {}
    reference = configs[REFERENCE]
    keys = ("host_blocks", "hit_rate", "mean_ttft_s", "p50_ttft_s", "host_hit_mean_ttft_s")
    keys += ("host_hit_mean_copy_s", "block_bytes")
    ratios = {}
    for name, config in configs.items():
        ratios[name] = {key: config[key] / reference[key] for key in keys}
        pairs = [
            i
            for i, tokens in enumerate(served[name].host_tokens)
            if tokens and tokens == served[REFERENCE].host_tokens[i]
        ]
        for key in ("ttft_s", "copy_s"):
            ours = _mean([getattr(served[name], key)[i] for i in pairs])
            theirs = _mean([getattr(served[REFERENCE], key)[i] for i in pairs])
            ratios[name][f"paired_host_hit_{key}"] = ours / theirs if pairs else float("nan")
        ratios[name]["num_paired_host_hits"] = len(pairs)
    return ratios


def _targets(ratios: dict[str, dict[str, float]]) -> list[dict[str, object]]:
    """The issue's targets, int8 over bfloat16 KV, where both were served."""
    if "int8" not in ratios:
        return []
    rows = []
    for measure, (key, bound, sense) in TARGETS.items():
        value = ratios["int8"][key]
        met = value >= bound if sense == ">=" else value <= bound
        rows.append({"measure": measure, "value": value, "target": f"{sense} {bound}", "met": met})
    return rows


def _label(name: str, resolved: str) -> str:
    return f"{name} ({resolved})" if name != resolved else name


def _add_tables(
    report: Report,
    settings: Settings,
    configs: dict[str, dict],
    labels: dict[str, str],
    ratios: dict[str, dict[str, float]],
    targets: list[dict[str, object]],
    unbounded: float,
    host_bytes: int,
) -> None:
    report.add_table(
        f"{settings.num_requests} sequential requests, host budget {host_bytes} bytes "
        f"(unbounded-cache hit rate {unbounded:.3f})",
        ["KV dtype", "bytes per block", "NPU blocks", "host blocks", "hit rate", "npu hits"]
        + ["host hits", "mean TTFT (ms)", "p50 (ms)", "p99 (ms)"],
        [
            [labels[name], c["block_bytes"], c["npu_blocks"], c["host_blocks"], c["hit_rate"]]
            + [c["npu_hit_rate"], c["host_hit_rate"]]
            + [1e3 * c[f"{k}_ttft_s"] for k in ("mean", "p50", "p99")]
            for name, c in configs.items()
        ],
    )
    report.add_table(
        "Host hits: requests whose prefix came (in part or whole) from the host tier",
        ["KV dtype", "host hits", "mean host tokens", "mean TTFT (ms)", "mean load copy (ms)"]
        + ["copy share of TTFT"],
        [
            [labels[name], c["num_host_hits"], c["host_hit_mean_host_tokens"]]
            + [1e3 * c["host_hit_mean_ttft_s"], 1e3 * c["host_hit_mean_copy_s"]]
            + [c["host_hit_mean_copy_s"] / c["host_hit_mean_ttft_s"]]
            for name, c in configs.items()
        ],
    )
    if ratios:
        report.add_table(
            "Over bfloat16 KV",
            ["KV dtype", "host blocks", "hit rate", "mean TTFT", "p50 TTFT", "host-hit TTFT"]
            + ["host-hit load copy", "bytes per block", "paired host hits", "their TTFT"]
            + ["their load copy"],
            [
                [labels[name]]
                + [r[k] for k in ("host_blocks", "hit_rate", "mean_ttft_s", "p50_ttft_s")]
                + [r[k] for k in ("host_hit_mean_ttft_s", "host_hit_mean_copy_s", "block_bytes")]
                + [r["num_paired_host_hits"], r["paired_host_hit_ttft_s"]]
                + [r["paired_host_hit_copy_s"]]
                for name, r in ratios.items()
            ],
        )
    if targets:
        report.add_table(
            "Targets (int8 KV over bfloat16 KV at one host budget)",
            ["measure", "value", "target", "met"],
            [[t["measure"], t["value"], t["target"], t["met"]] for t in targets],
        )
    report.sections.append(
        "Every engine has the same NPU tier in blocks, so the KV dtype changes only how many "
        "blocks the host budget holds and how many bytes each reload moves. *load copy* is "
        "the transfer component's time during the request (the host hit's loads, and any "
        "write-back stores its step made); the rest of a host hit's TTFT is the step: the "
        "prefill of the uncached tokens, attention over the whole prefix (dequantizing an "
        "8-bit KV's rows) and the step's fixed cost. *paired host hits* are the requests "
        "an engine and the bfloat16 one both served as host hits of equally many host tokens: "
        "the same reloads, so their TTFT ratio isolates what the KV dtype costs a reload."
    )


def _plot(
    configs: dict[str, dict], labels: dict[str, str], served: dict[str, Served], unbounded: float
) -> Figure:
    figure, (left, right) = new_figure(2)
    for name, s in served.items():
        ordered = sorted(1e3 * v for v in s.ttft_s)
        fractions = [(k + 1) / len(ordered) for k in range(len(ordered))]
        left.plot(ordered, fractions, label=labels[name])
    left.set_xscale("log")
    left.set_xlabel("TTFT (ms, log)")
    left.set_ylabel("fraction of requests")
    left.set_title("TTFT distribution")
    left.legend()
    names = [labels[n] for n in configs]
    npu = [c["npu_hit_rate"] for c in configs.values()]
    right.bar(names, npu, label="npu hits")
    right.bar(names, [c["host_hit_rate"] for c in configs.values()], bottom=npu, label="host hits")
    right.axhline(unbounded, linestyle="--", color="black", linewidth=0.8, label="unbounded")
    right.set_ylabel("token hit rate")
    right.set_title("hit rate by tier, one host budget")
    right.legend()
    return figure
