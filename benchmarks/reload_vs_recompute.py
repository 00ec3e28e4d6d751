"""reload-vs-recompute: TTFT of a prefix recomputed (cold) vs reused from NPU vs reloaded from
host vs read from disk.

Each prompt is a shared prefix of ``prefix_len`` tokens plus a few fresh tokens. The host tier
runs with ``write_through_threshold="immediate"``, so every block is stored to host when first
written. Per repetition: *cold* resets the whole prefix cache and computes everything; *npu*
finds the prefix on the NPU tier; *host* first drops the NPU tier
(``reset_prefix_cache("npu")``), so the prefix is found on host only and reloaded; *disk* drops
the NPU and host tiers, so the prefix is read from the disk tier (a directory under the output
folder, stored at first write too) into host and loaded; *disk, dropped* also has the kernel
drop the slab file's cached pages first (``posix_fadvise(DONTNEED)`` after ``fdatasync``), so
the reads come from the device. Cold runs first (it writes the prefix and resets every tier,
disk included); the others then take turns in rotating order. An idle engine step after each
request lands its planned stores, and the disk writes are waited for, so no measured request
pays for an earlier one's copies."""

import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    build_llm,
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

NAME = "reload-vs-recompute"
MODES = ("cold", "npu", "host", "disk", "disk_dropped")
HOST_OVER_COLD_TARGET = 0.1  # at 2k tokens and beyond
HOST_OVER_COLD_MIN_LEN = 2048
HOST_OVER_NPU_TARGET = 1.5


@dataclass(frozen=True, slots=True)
class Settings:
    prefix_lens: tuple[int, ...] = (512, 2048, 8192)
    suffix_len: int = 8
    repeats: int = 7
    host_memory_ratio: float = 2.0


QUICK = Settings(prefix_lens=(256, 1024), repeats=2)


def _measure(
    llm: LLM, settings: Settings, prefix_len: int, rng: random.Random
) -> dict[str, list[float]]:
    vocab = prompt_vocab(llm)
    prefix = random_tokens(rng, prefix_len, vocab)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    samples["load"] = []
    transfer = llm.engine.transfer
    stores = llm.engine.disk.values()
    for rep in range(-1, settings.repeats):  # repetition -1 warms up this size, unrecorded
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
            output = timed_request(llm, prefix + random_tokens(rng, settings.suffix_len, vocab))
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
            expected = 0 if mode == "cold" else prefix_len
            if found != expected or (mode != "cold" and output.num_cached_tokens != prefix_len):
                raise RuntimeError(f"{mode} run at {prefix_len} tokens matched {found} tokens")
            if rep >= 0:
                samples[mode].append(output.ttft_s)
                if mode == "host":
                    samples["load"].append(load_s)
    return samples


def run(
    output_dir: Path,
    *,
    quick: bool,
    command: str,
    model: str = DEFAULT_MODEL,
    device: str | None = None,
    dtypes: Sequence[str] | None = None,
) -> dict[str, object]:
    """``device``: where the engine runs (default: the engine's ``auto``); ``dtypes``: one
    weights and KV dtype (default: the engine's, float32)."""
    if dtypes is not None and len(dtypes) != 1:
        raise ValueError(f"reload-vs-recompute measures one dtype at a time, got {list(dtypes)}")
    settings = QUICK if quick else Settings()
    # A prefix longer than the model's context becomes the most whole blocks that fit.
    limit = model_context_len(model) - settings.suffix_len - 8
    prefix_lens = tuple(dict.fromkeys(fit_length(n, limit) for n in settings.prefix_lens))
    settings = replace(settings, prefix_lens=prefix_lens)
    rng = random.Random(0)
    max_len = max(settings.prefix_lens) + settings.suffix_len
    num_npu_blocks = -(-max_len // BLOCK_SIZE) + 2 * BLOCK_SIZE
    output_dir.mkdir(parents=True, exist_ok=True)
    disk_dir = tempfile.mkdtemp(prefix="disk-tier-", dir=output_dir)
    block_bytes = kv_block_bytes(model, dtypes[0] if dtypes else "float32")
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=settings.host_memory_ratio,
        write_through_threshold="immediate",
        disk_path=disk_dir,
        disk_bytes=2 * num_npu_blocks * block_bytes,
    )
    options = {} if device is None else {"device": device}
    if dtypes is not None:
        options["dtype"] = dtypes[0]
    llm = build_llm(
        num_npu_blocks=num_npu_blocks,
        max_model_len=max_len + 8,
        offload=offload,
        model=model,
        **options,
    )

    sizes, all_samples = [], {}
    for prefix_len in settings.prefix_lens:
        print(f"prefix of {prefix_len} tokens ...", flush=True)
        samples = _measure(llm, settings, prefix_len, rng)
        llm.check_integrity()
        ttft = {mode: median(samples[mode]) for mode in MODES}
        ratios = {
            "host_over_cold": ttft["host"] / ttft["cold"],
            "host_over_npu": ttft["host"] / ttft["npu"],
            "npu_over_cold": ttft["npu"] / ttft["cold"],
            "disk_over_cold": ttft["disk"] / ttft["cold"],
            "disk_dropped_over_cold": ttft["disk_dropped"] / ttft["cold"],
            "disk_over_host": ttft["disk"] / ttft["host"],
        }
        targets = {"host_over_npu": ratios["host_over_npu"] <= HOST_OVER_NPU_TARGET}
        if prefix_len >= HOST_OVER_COLD_MIN_LEN:
            targets["host_over_cold"] = ratios["host_over_cold"] <= HOST_OVER_COLD_TARGET
        sizes.append(
            {
                "prefix_len": prefix_len,
                "median_ttft_s": ttft,
                "median_load_s": median(samples["load"]),
                "ratios": ratios,
                "targets_met": targets,
            }
        )
        all_samples[str(prefix_len)] = samples
    device_name = str(llm.engine.device)
    llm.shutdown()
    shutil.rmtree(disk_dir, ignore_errors=True)

    report = Report(
        NAME,
        f"Reload from host vs recompute: TTFT by prefix length, model {model} "
        f"({llm.config.model.dtype})",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        f"Median TTFT (ms) over {settings.repeats} interleaved repetitions",
        [
            "prefix tokens",
            "cold",
            "npu hit",
            "host hit",
            "disk hit",
            "disk hit, pages dropped",
            "host load copy",
            "host - npu",
        ],
        [
            [s["prefix_len"], *(1e3 * s["median_ttft_s"][mode] for mode in MODES)]
            + [
                1e3 * s["median_load_s"],
                1e3 * (s["median_ttft_s"]["host"] - s["median_ttft_s"]["npu"]),
            ]
            for s in sizes
        ],
    )
    report.add_table(
        f"Ratios and targets (host/cold <= {HOST_OVER_COLD_TARGET} from "
        f"{HOST_OVER_COLD_MIN_LEN} tokens, host/npu <= {HOST_OVER_NPU_TARGET})",
        ["prefix tokens", "host / cold", "target", "host / npu", "target", "npu / cold"],
        [
            [
                s["prefix_len"],
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
        ["prefix tokens", "disk / cold", "disk dropped / cold", "disk / host"],
        [
            [
                s["prefix_len"],
                s["ratios"]["disk_over_cold"],
                s["ratios"]["disk_dropped_over_cold"],
                s["ratios"]["disk_over_host"],
            ]
            for s in sizes
        ],
    )
    report.sections.append(
        "*host load copy* is the transfer component's time for the host hit's load (gather from "
        "the host pool and scatter into the NPU pool); the rest of *host - npu* is the engine "
        "step around it. See the `transfer` scenario for the copy's throughput."
    )
    figure, (left, right) = new_figure(2)
    width = 0.16
    for i, mode in enumerate(MODES):
        xs = [j + (i - 2) * width for j in range(len(sizes))]
        left.bar(xs, [1e3 * s["median_ttft_s"][mode] for s in sizes], width, label=mode)
    left.set_xticks(range(len(sizes)), [str(s["prefix_len"]) for s in sizes])
    left.set_yscale("log")
    left.set_xlabel("prefix tokens")
    left.set_ylabel("median TTFT (ms, log)")
    left.legend()
    lens = [s["prefix_len"] for s in sizes]
    for key, target in (("host_over_cold", HOST_OVER_COLD_TARGET), ("host_over_npu", 1.5)):
        line = right.plot(lens, [s["ratios"][key] for s in sizes], marker="o", label=key)
        right.axhline(target, linestyle="--", color=line[0].get_color(), linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_xticks(lens, [str(n) for n in lens])
    right.set_yscale("log")
    right.set_xlabel("prefix tokens")
    right.set_ylabel("ratio of median TTFT (dashed: target)")
    right.legend()
    report.figures["ttft_by_tier.png"] = figure
    report.results = {
        "model": model,
        "device": device_name,
        "dtype": llm.config.model.dtype,
        "settings": asdict(settings),
        "sizes": sizes,
        "samples_s": all_samples,
    }
    return report.write(output_dir)
