"""churn-disk: the churn workload with a working set 4x the host tier, host-only vs host + disk.

Each request is one of ``num_prefixes`` prefixes (Zipf(``zipf_s``) popularity) plus a few fresh
tokens. The NPU tier holds ``npu_tier_prefixes`` prefixes, the host tier ``host_memory_ratio``
times that, and the prefixes together fill ``4 x`` the host tier. Both engines write back: a
block the NPU tier evicts goes to host; with the disk tier, a block host evicts goes to disk
(budget: the whole working set). The engines serve the identical sequence one request at a
time, taking turns request by request (the order rotates). The disk tier lives in a directory
under the output folder; the page cache holds what was written recently, as it would on a
serving machine.
"""

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.churn import (
    _plot,
    add_ttft_table,
    churn_prompts,
    fit_prefix,
    serve_in_turns,
    unbounded_hit_rate,
)
from benchmarks.report import Report
from benchmarks.workload import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    build_llm,
    kv_block_bytes,
    prompt_vocab,
)
from cluster import KVOffloadConfig

NAME = "churn-disk"
VARIANTS = ("host", "host+disk")
DISK_OVER_HOST_MEAN_TARGET = 0.5


@dataclass(frozen=True, slots=True)
class Settings:
    num_prefixes: int = 32
    prefix_len: int = 1024
    suffix_len: int = 8
    npu_tier_prefixes: int = 4
    host_memory_ratio: float = 2.0  # host tier = 8 prefixes = working set / 4
    num_requests: int = 400
    zipf_s: float = 1.0
    seed: int = 0


QUICK = Settings(num_prefixes=16, prefix_len=256, npu_tier_prefixes=2, num_requests=48)


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = DEFAULT_MODEL
) -> dict[str, object]:
    settings = fit_prefix(QUICK if quick else Settings(), model)
    num_npu_blocks = settings.npu_tier_prefixes * settings.prefix_len // BLOCK_SIZE
    max_model_len = settings.prefix_len + settings.suffix_len + 8
    block_bytes = kv_block_bytes(model, "float32")
    output_dir.mkdir(parents=True, exist_ok=True)
    disk_dir = tempfile.mkdtemp(prefix="disk-tier-", dir=output_dir)
    working_set_blocks = settings.num_prefixes * settings.prefix_len // BLOCK_SIZE

    def offload(**disk: object) -> KVOffloadConfig:
        return KVOffloadConfig(
            enabled=True,
            host_memory_ratio=settings.host_memory_ratio,
            write_through_threshold=2,
            write_back=True,
            **disk,
        )

    variants = {
        "host": offload(),
        "host+disk": offload(disk_path=disk_dir, disk_bytes=2 * working_set_blocks * block_bytes),
    }
    llms = {
        name: build_llm(
            num_npu_blocks=num_npu_blocks, max_model_len=max_model_len, model=model, offload=config
        )
        for name, config in variants.items()
    }
    vocab = prompt_vocab(llms["host"])
    sequence, prompts = churn_prompts(settings, vocab)
    prompt_len = settings.prefix_len + settings.suffix_len
    configs, ttfts = serve_in_turns(llms, prompts)
    disk_counters = llms["host+disk"].stats().cache
    for llm in llms.values():
        llm.shutdown()
    shutil.rmtree(disk_dir, ignore_errors=True)
    unbounded = unbounded_hit_rate(sequence, settings.prefix_len, prompt_len)
    ratio = configs["host+disk"]["mean_ttft_s"] / configs["host"]["mean_ttft_s"]
    p99_ratio = configs["host+disk"]["p99_ttft_s"] / configs["host"]["p99_ttft_s"]
    disk = {
        "disk_hit_rate": disk_counters.disk_hits / disk_counters.queries,
        "disk_blocks_loaded": disk_counters.disk_blocks_loaded,
        "disk_blocks_stored": disk_counters.disk_blocks_stored,
        "disk_load_failures": disk_counters.disk_load_failures,
        "disk_reloads": disk_counters.disk_reloads,
        "disk_recomputes": disk_counters.disk_recomputes,
    }

    host_prefixes = settings.npu_tier_prefixes * settings.host_memory_ratio
    report = Report(
        NAME,
        f"Churn with a disk tier: {settings.num_prefixes} prefixes of {settings.prefix_len} "
        f"tokens, Zipf {settings.zipf_s}, working set {settings.num_prefixes / host_prefixes:g}x "
        f"the host tier, model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    add_ttft_table(report, settings.num_requests, prompt_len, unbounded, configs)
    report.add_table(
        "Disk tier counters (host hits include the disk's: its blocks reach NPU through host)",
        list(disk),
        [list(disk.values())],
    )
    met = ratio <= DISK_OVER_HOST_MEAN_TARGET
    report.add_table(
        "Target",
        ["ratio", "value", "target", "met"],
        [["host+disk mean TTFT / host", ratio, f"<= {DISK_OVER_HOST_MEAN_TARGET}", met]],
    )
    report.figures["churn_disk.png"] = _plot(settings, configs, ttfts, unbounded)
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "unbounded_hit_rate": unbounded,
        "configs": configs,
        "disk": disk,
        "ratios": {"disk_over_host_mean": ratio, "disk_over_host_p99": p99_ratio},
        "target_met": met,
        "ttft_s": ttfts,
    }
    return report.write(output_dir)
