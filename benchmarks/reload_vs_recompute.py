"""reload-vs-recompute: TTFT of a prefix recomputed (cold) vs reused from NPU vs reloaded from
host vs read from disk, for each KV dtype.

One engine per KV dtype (``kv_cache_dtype``: by default the engine dtype, bfloat16, int8 and
fp8_e4m3), the same prefixes through each. Each prompt is a shared prefix of ``prefix_len``
tokens plus a few fresh tokens. The host tier runs with ``write_through_threshold="immediate"``,
so every block is stored to host when first written. Per repetition: *cold* resets the whole
prefix cache and computes everything; *npu* finds the prefix on the NPU tier; *host* first
drops the NPU tier (``reset_prefix_cache("npu")``), so the prefix is found on host only and
reloaded; *disk* drops the NPU and host tiers, so the prefix is read from the disk tier (a
directory under the output folder, stored at first write too) into host and loaded; *disk,
dropped* also has the kernel drop the slab file's cached pages first
(``posix_fadvise(DONTNEED)`` after ``fdatasync``), so the reads come from the device. In each
repetition the engines take turns in rotating order; on each, cold runs first (it writes the
prefix and resets every tier, disk included) and the other modes then take turns in rotating
order. An idle engine step after each request lands its planned stores, and the disk writes are
waited for, so no measured request pays for an earlier one's copies.

Beside the TTFTs (``benchmarks.tier_copies``, on the first engine): the load and store GiB/s
of the transfer component for the blocks of the largest prefix (at most ``COPY_BLOCKS``),
against plain pinned copies of the same bytes, and the delay a store of the smallest prefix's
blocks (one write-through store) adds to the decode step it runs beside. An 8B-shaped built-in
model (``llama3-8b-shape``, ``qwen3-8b-shape``) measures 2k, 8k and 32k-token prefixes
(``REAL_SHAPE``; 2k and 8k with ``--quick``)."""

import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from matplotlib.figure import Figure

from benchmarks import tier_copies
from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    build_llm,
    engine_options,
    fit_length,
    kv_block_bytes,
    median,
    model_context_len,
    prompt_vocab,
    random_tokens,
    rotated,
    settle,
    timed_request,
)
from cluster import LLM, KVOffloadConfig
from replicas.kv.events import Tier
from replicas.model.builtin import REAL_SHAPE_MODELS

NAME = "reload-vs-recompute"
MODES = ("cold", "npu", "host", "disk", "disk_dropped")
HOST_OVER_COLD_TARGET = 0.1  # at 2k tokens and beyond
HOST_OVER_COLD_MIN_LEN = 2048
HOST_OVER_NPU_TARGET = 1.5
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8_e4m3")  # auto: the engine dtype


@dataclass(frozen=True, slots=True)
class Settings:
    prefix_lens: tuple[int, ...] = (512, 2048, 8192)
    suffix_len: int = 8
    repeats: int = 7
    host_memory_ratio: float = 2.0


QUICK = Settings(prefix_lens=(256, 1024), repeats=2)
REAL_SHAPE = Settings(prefix_lens=(2048, 8192, 32768), repeats=3)
REAL_SHAPE_QUICK = Settings(prefix_lens=(2048, 8192), repeats=2)
COPY_BLOCKS = 512  # the most blocks of the copy rates' plans (1 GiB of an 8B model's KV)
STORE_DELAY_STEPS = 16  # decode steps with a store beside them, and as many without


def _measure(
    llms: dict[str, LLM], settings: Settings, prefix_len: int, rng: random.Random
) -> dict[str, dict[str, list[float]]]:
    """TTFT samples per engine (by KV dtype) and mode, and each host hit's load copy."""
    vocab = prompt_vocab(next(iter(llms.values())))
    prefix = random_tokens(rng, prefix_len, vocab)
    samples = {name: {mode: [] for mode in (*MODES, "load")} for name in llms}
    for rep in range(-1, settings.repeats):  # repetition -1 warms up this size, unrecorded
        for name in rotated(list(llms), rep):
            measured = _repetition(llms[name], prefix, settings.suffix_len, vocab, rep, rng)
            if rep >= 0:
                for mode, seconds in measured.items():
                    samples[name][mode].append(seconds)
    return samples


def _repetition(
    llm: LLM, prefix: list[int], suffix_len: int, vocab: int, rep: int, rng: random.Random
) -> dict[str, float]:
    """One TTFT per mode on ``llm``, cold first, and the host hit's load copy (``load``)."""
    transfer = llm.engine.transfer
    stores = llm.engine.backing.get("disk", {}).values()
    measured = {}
    for mode in ["cold", *rotated(["npu", "host", "disk", "disk_dropped"], rep)]:
        if mode == "cold":
            llm.reset_prefix_cache("all")
        elif mode == "host":
            llm.reset_prefix_cache("npu")
        elif mode.startswith("disk"):
            llm.reset_prefix_cache("npu")
            llm.reset_prefix_cache("host")
            for store in stores:
                store.drop_page_cache() if mode == "disk_dropped" else store.flush()
        seconds_before = transfer.stats.seconds
        output = timed_request(llm, prefix + random_tokens(rng, suffix_len, vocab))
        load_s = transfer.stats.seconds - seconds_before
        settle(llm)
        settle(llm)  # the disk stores a landed host store planned
        for store in stores:
            store.flush()
        found = {
            "cold": output.num_cached_tokens,
            "npu": output.num_cached_tokens_in(Tier.NPU),
            "host": output.num_cached_tokens_in(Tier.HOST),
            "disk": output.num_cached_tokens_in(Tier.HOST),  # disk blocks load through host
            "disk_dropped": output.num_cached_tokens_in(Tier.HOST),
        }[mode]
        expected = 0 if mode == "cold" else len(prefix)
        if found != expected or (mode != "cold" and output.num_cached_tokens != len(prefix)):
            raise RuntimeError(f"{mode} run at {len(prefix)} tokens matched {found} tokens")
        measured[mode] = output.ttft_s
        if mode == "host":
            measured["load"] = load_s
    return measured


def run(
    output_dir: Path,
    *,
    quick: bool,
    command: str,
    model: str = DEFAULT_MODEL,
    device: str | None = None,
    dtypes: Sequence[str] | None = None,
    kv_cache_dtypes: Sequence[str] | None = None,
) -> dict[str, object]:
    """``device``: where the engines run (default: the engine's ``auto``); ``dtypes``: one
    weights dtype (default: the engine's, float32); ``kv_cache_dtypes``: the KV dtypes measured
    side by side (default ``KV_CACHE_DTYPES``; ``auto``: the engine dtype)."""
    options = engine_options(NAME, device, dtypes)
    if model in REAL_SHAPE_MODELS:
        settings = REAL_SHAPE_QUICK if quick else REAL_SHAPE
    else:
        settings = QUICK if quick else Settings()
    # A prefix longer than the model's context becomes the most whole blocks that fit.
    limit = model_context_len(model) - settings.suffix_len - 8
    prefix_lens = tuple(dict.fromkeys(fit_length(n, limit) for n in settings.prefix_lens))
    settings = replace(settings, prefix_lens=prefix_lens)
    rng = random.Random(0)
    output_dir.mkdir(parents=True, exist_ok=True)
    llms, disk_dirs = _build_engines(settings, model, kv_cache_dtypes, output_dir, options)
    kv_names = {name: llm.engine.config.kv_cache_dtype for name, llm in llms.items()}
    reference = next(iter(llms))  # the engine dtype's KV, unless not asked for

    sizes, all_samples = [], {}
    for prefix_len in settings.prefix_lens:
        print(f"prefix of {prefix_len} tokens ...", flush=True)
        samples = _measure(llms, settings, prefix_len, rng)
        for llm in llms.values():
            llm.check_integrity()
        medians = {name: {mode: median(v) for mode, v in samples[name].items()} for name in llms}
        for name in llms:
            sizes.append(_size_row(prefix_len, name, kv_names[name], medians, reference))
        all_samples[str(prefix_len)] = samples
    block_bytes = {name: _loaded_block_bytes(llm) for name, llm in llms.items()}
    copies = _copies(llms[reference], settings)
    for row in sizes:
        row["block_bytes"] = block_bytes[row["kv_cache_dtype"]]
    device_name = str(next(iter(llms.values())).engine.device)
    dtype = next(iter(llms.values())).engine.config.dtype
    for llm in llms.values():
        llm.shutdown()
    for disk_dir in disk_dirs:
        shutil.rmtree(disk_dir, ignore_errors=True)

    labels = {name: _label(name, kv_names[name]) for name in llms}
    report = Report(
        NAME,
        f"Reload from host vs recompute: TTFT by prefix length and KV dtype, model {model} "
        f"({dtype})",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    _add_tables(report, settings, sizes, labels, reference)
    _add_copy_tables(report, copies, labels[reference])
    report.figures["ttft_by_tier.png"] = _plot(sizes, labels)
    report.results = {
        "model": model,
        "device": device_name,
        "dtype": dtype,
        "kv_cache_dtypes": {
            name: {"resolved": kv_names[name], "block_bytes": block_bytes[name]} for name in llms
        },
        "reference_kv_cache_dtype": reference,
        "settings": asdict(settings),
        "sizes": sizes,
        "samples_s": all_samples,
        **copies,
    }
    return report.write(output_dir)


def _copies(llm: LLM, settings: Settings) -> dict[str, dict[str, float]]:
    """The transfer component's copy rates and one store's delay to a decode step."""
    largest = max(settings.prefix_lens) // BLOCK_SIZE
    smallest = min(settings.prefix_lens) // BLOCK_SIZE
    return {
        "copy_rates": tier_copies.copy_rates(llm, min(largest, COPY_BLOCKS), settings.repeats),
        "store_delay": tier_copies.store_delay(llm, smallest, STORE_DELAY_STEPS),
    }


def _add_copy_tables(report: Report, copies: dict[str, dict[str, float]], label: str) -> None:
    rates, delay = copies["copy_rates"], copies["store_delay"]
    report.add_table(
        f"Host tier copies of {rates['num_blocks']} blocks ({rates['bytes'] / 2**20:.0f} MiB, "
        f"KV {label}), GiB/s, against plain pinned copies of the same bytes",
        ["direction", "host ids in order", "host ids shuffled", "pinned copy", "in order / pinned"],
        [
            [
                name,
                rates[f"{kind}_in_order_gib_per_s"],
                rates[f"{kind}_shuffled_gib_per_s"],
                rates[f"pinned_{bus}_gib_per_s"],
                rates[f"{kind}_over_pinned"],
            ]
            for name, kind, bus in (
                ("load (host -> NPU)", "load", "h2d"),
                ("store", "store", "d2h"),
            )
        ],
    )
    report.add_table(
        f"A store of {delay['num_blocks']} blocks ({delay['bytes'] / 2**20:.0f} MiB) beside a "
        "decode step (medians)",
        ["step (ms)", "step with the store (ms)", "delay"],
        [[1e3 * delay["step_s"], 1e3 * delay["step_with_store_s"], delay["delay"]]],
    )


def _build_engines(
    settings: Settings,
    model: str,
    kv_cache_dtypes: Sequence[str] | None,
    output_dir: Path,
    options: dict[str, object],
) -> tuple[dict[str, LLM], list[str]]:
    """One engine per KV dtype, each with its own disk tier directory; an option that resolves
    to the KV dtype of an engine already built (``auto`` and the engine dtype) is dropped."""
    max_len = max(settings.prefix_lens) + settings.suffix_len
    num_npu_blocks = -(-max_len // BLOCK_SIZE) + 2 * BLOCK_SIZE
    # The widest block of the engine dtype sizes every disk tier: twice any KV dtype's NPU tier.
    dtype = str(options.get("dtype", "float32"))
    widest = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
    disk_bytes = 2 * num_npu_blocks * kv_block_bytes(model, widest, widest)
    llms: dict[str, LLM] = {}
    disk_dirs = []
    for name in dict.fromkeys(kv_cache_dtypes or KV_CACHE_DTYPES):
        disk_dir = tempfile.mkdtemp(prefix=f"disk-tier-{name}-", dir=output_dir)
        disk_dirs.append(disk_dir)
        offload = KVOffloadConfig(
            enabled=True,
            host_memory_ratio=settings.host_memory_ratio,
            write_through_threshold="immediate",
            disk_path=disk_dir,
            disk_bytes=disk_bytes,
        )
        llm = build_llm(
            num_npu_blocks=num_npu_blocks,
            max_model_len=max_len + 8,
            offload=offload,
            model=model,
            kv_cache_dtype=name,
            **options,
        )
        resolved = llm.engine.config.kv_cache_dtype
        if any(other.engine.config.kv_cache_dtype == resolved for other in llms.values()):
            llm.shutdown()
            continue
        llms[name] = llm
    return llms, disk_dirs


def _size_row(
    prefix_len: int, name: str, resolved: str, medians: dict[str, dict[str, float]], ref: str
) -> dict[str, object]:
    """One prefix length on one KV dtype: median TTFTs, ratios between modes, the host hit and
    its load copy over the reference KV dtype's, and the targets."""
    ttft = {mode: medians[name][mode] for mode in MODES}
    ratios = {
        "host_over_cold": ttft["host"] / ttft["cold"],
        "host_over_npu": ttft["host"] / ttft["npu"],
        "npu_over_cold": ttft["npu"] / ttft["cold"],
        "disk_over_cold": ttft["disk"] / ttft["cold"],
        "disk_dropped_over_cold": ttft["disk_dropped"] / ttft["cold"],
        "disk_over_host": ttft["disk"] / ttft["host"],
        "host_over_reference_host": ttft["host"] / medians[ref]["host"],
        "load_over_reference_load": medians[name]["load"] / medians[ref]["load"],
        "cold_over_reference_cold": ttft["cold"] / medians[ref]["cold"],
    }
    targets = {"host_over_npu": ratios["host_over_npu"] <= HOST_OVER_NPU_TARGET}
    if prefix_len >= HOST_OVER_COLD_MIN_LEN:
        targets["host_over_cold"] = ratios["host_over_cold"] <= HOST_OVER_COLD_TARGET
    return {
        "prefix_len": prefix_len,
        "kv_cache_dtype": name,
        "kv_cache_dtype_resolved": resolved,
        "median_ttft_s": ttft,
        "median_load_s": medians[name]["load"],
        "ratios": ratios,
        "targets_met": targets,
    }


def _loaded_block_bytes(llm: LLM) -> int:
    """Bytes one block's host -> NPU copy moved, as the transfer component counted them."""
    stats = llm.stats().transfer
    return stats.bytes_loaded // stats.blocks_loaded


def _label(name: str, resolved: str) -> str:
    return f"{name} ({resolved})" if name != resolved else name


def _add_tables(
    report: Report, settings: Settings, sizes: list[dict], labels: dict[str, str], reference: str
) -> None:
    def head(s: dict) -> list[object]:
        return [s["prefix_len"], labels[s["kv_cache_dtype"]]]

    report.add_table(
        f"Median TTFT (ms) over {settings.repeats} interleaved repetitions",
        [
            "prefix tokens",
            "KV dtype",
            "cold",
            "npu hit",
            "host hit",
            "disk hit",
            "disk hit, pages dropped",
            "host load copy",
            "host - npu",
        ],
        [
            [*head(s), *(1e3 * s["median_ttft_s"][mode] for mode in MODES)]
            + [
                1e3 * s["median_load_s"],
                1e3 * (s["median_ttft_s"]["host"] - s["median_ttft_s"]["npu"]),
            ]
            for s in sizes
        ],
    )
    report.add_table(
        f"KV dtype: bytes per block and the host hit, over {labels[reference]}'s",
        [
            "prefix tokens",
            "KV dtype",
            "bytes per block",
            "host hit (ms)",
            "host load copy (ms)",
            "host / cold",
            "host hit / ref",
            "load copy / ref",
            "bytes / ref",
            "cold / ref",
        ],
        [
            [*head(s), s["block_bytes"], 1e3 * s["median_ttft_s"]["host"]]
            + [1e3 * s["median_load_s"], s["ratios"]["host_over_cold"]]
            + [s["ratios"]["host_over_reference_host"], s["ratios"]["load_over_reference_load"]]
            + [s["block_bytes"] / _reference_bytes(sizes, reference)]
            + [s["ratios"]["cold_over_reference_cold"]]
            for s in sizes
        ],
    )
    report.add_table(
        f"Ratios and targets (host/cold <= {HOST_OVER_COLD_TARGET} from "
        f"{HOST_OVER_COLD_MIN_LEN} tokens, host/npu <= {HOST_OVER_NPU_TARGET})",
        ["prefix tokens", "KV dtype", "host / cold", "target", "host / npu", "target"]
        + ["npu / cold"],
        [
            [
                *head(s),
                s["ratios"]["host_over_cold"],
                s["targets_met"].get("host_over_cold", "n/a"),
                s["ratios"]["host_over_npu"],
                s["targets_met"]["host_over_npu"],
                s["ratios"]["npu_over_cold"],
            ]
            for s in sizes
        ],
    )
    report.add_table(
        "Disk tier ratios (a disk hit reads the prefix into host blocks while the request waits, "
        "then loads it like a host hit)",
        ["prefix tokens", "KV dtype", "disk / cold", "disk dropped / cold", "disk / host"],
        [
            [
                *head(s),
                s["ratios"]["disk_over_cold"],
                s["ratios"]["disk_dropped_over_cold"],
                s["ratios"]["disk_over_host"],
            ]
            for s in sizes
        ],
    )
    report.sections.append(
        "*host load copy* is the transfer component's time for the host hit's load (on a CPU "
        "one fused copy; on CUDA the copies' device time, direct from the pinned host slab); "
        "the rest of *host - npu* is the engine "
        "step around it. See the `transfer` scenario for the copy's throughput. *bytes per "
        "block* is what one block's load moved (scales included); *ref* is "
        f"{labels[reference]}, measured in the same repetitions."
    )


def _reference_bytes(sizes: list[dict], reference: str) -> int:
    return next(s["block_bytes"] for s in sizes if s["kv_cache_dtype"] == reference)


def _plot(sizes: list[dict], labels: dict[str, str]) -> Figure:
    """Left: host hit TTFT by prefix length and KV dtype; right: host / cold and host / npu."""
    figure, (left, right) = new_figure(2)
    lens = list(dict.fromkeys(s["prefix_len"] for s in sizes))
    width = 0.8 / len(labels)
    for i, (name, label) in enumerate(labels.items()):
        rows = [s for s in sizes if s["kv_cache_dtype"] == name]
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(rows))]
        left.bar(xs, [1e3 * s["median_ttft_s"]["host"] for s in rows], width, label=label)
        for key, marker in (("host_over_cold", "o"), ("host_over_npu", "s")):
            values = [s["ratios"][key] for s in rows]
            right.plot(lens, values, marker=marker, label=f"{key}, {label}")
    left.set_xticks(range(len(lens)), [str(n) for n in lens])
    left.set_xlabel("prefix tokens")
    left.set_ylabel("median host hit TTFT (ms)")
    left.legend()
    for target in (HOST_OVER_COLD_TARGET, HOST_OVER_NPU_TARGET):
        right.axhline(target, linestyle="--", color="black", linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_xticks(lens, [str(n) for n in lens])
    right.set_yscale("log")
    right.set_xlabel("prefix tokens")
    right.set_ylabel("ratio of median TTFT (dashed: targets)")
    right.legend(fontsize="x-small")
    return figure
