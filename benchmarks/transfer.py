"""transfer: NPU <-> host block copy throughput of KVTransfer vs one contiguous copy.

``KVTransfer.submit`` copies one step's plan of random, non-contiguous block ids (store: NPU ->
host; load: host -> NPU) over pools laid out as the ``tiny`` model's KV cache. The reference is
one contiguous ``dst.copy_(src)`` of the same number of blocks between the same two pools, at
random offsets. For comparison, the two halves of a staging design are timed alone: a gather
(``index_select`` into a new tensor, and into a preallocated one) and a scatter (``index_copy_``
into the destination pool); ``KVTransfer`` itself copies block to block in one fused call.
Variants take turns within each repetition (the order rotates); medians are reported.
With ``--device cuda`` the NPU pools live on the GPU, every timed copy ends with a device
synchronize, and ``KVTransfer`` goes through its pinned staging blocks.
"""

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.report import Report, new_figure
from benchmarks.workload import BLOCK_SIZE, median, rotated
from replicas.kv.records import BlockCopy, TransferPlan
from replicas.kv.transfer import KVTransfer
from replicas.model import load_model

NAME = "transfer"
TARGET = 0.7  # transfer throughput / contiguous copy throughput
VARIANTS = ("contiguous", "store", "load", "gather", "gather_prealloc", "scatter")


@dataclass(frozen=True, slots=True)
class Settings:
    batch_blocks: tuple[int, ...] = (16, 64, 256, 1024)
    num_npu_blocks: int = 2048
    num_host_blocks: int = 4096
    repeats: int = 15
    seed: int = 0


QUICK = Settings(batch_blocks=(16, 64), num_npu_blocks=256, num_host_blocks=512, repeats=5)


def _clock(fn: Callable[[], object], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(device: str | None) -> torch.device:
    """``None``: the CPU; ``auto``: CUDA when available; ``cuda`` only where it is."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return torch.device(device or "cpu")


def _variants(transfer: KVTransfer, num_blocks: int, rng: random.Random) -> dict[str, Callable]:
    """One repetition's copies of ``num_blocks`` blocks, each with fresh random block ids."""
    npu, host = transfer.npu_caches["full"], transfer.host_caches["full"]
    npu_ids = rng.sample(range(len(npu)), num_blocks)
    host_ids = rng.sample(range(len(host)), num_blocks)
    npu_index, host_index = torch.tensor(npu_ids, device=npu.device), torch.tensor(host_ids)
    staging = npu.index_select(0, npu_index)
    host_staging = staging.cpu()  # what a scatter into the host pool reads
    a = rng.randrange(len(npu) - num_blocks + 1)
    b = rng.randrange(len(host) - num_blocks + 1)

    def submit(plan: TransferPlan) -> None:
        transfer.submit(plan)
        transfer.poll(wait=True)

    return {
        "contiguous": lambda: host[b : b + num_blocks].copy_(npu[a : a + num_blocks]),
        "store": lambda: submit(
            TransferPlan([BlockCopy(n, h) for n, h in zip(npu_ids, host_ids)], [])
        ),
        "load": lambda: submit(
            TransferPlan([], [BlockCopy(h, n) for h, n in zip(host_ids, npu_ids)])
        ),
        "gather": lambda: npu.index_select(0, npu_index),
        "gather_prealloc": lambda: torch.index_select(npu, 0, npu_index, out=staging),
        "scatter": lambda: host.index_copy_(0, host_index, host_staging),
    }


def run(
    output_dir: Path, *, quick: bool, command: str, device: str | None = None
) -> dict[str, object]:
    """``device``: where the NPU pools live (default: the CPU)."""
    settings = QUICK if quick else Settings()
    where = resolve_device(device)
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    specs = load_model("tiny", torch.device("cpu")).model.kv_cache_specs(torch.float32)
    npu_caches = {
        cache_type: torch.randn(spec.shape(settings.num_npu_blocks, BLOCK_SIZE)).to(where)
        for cache_type, spec in specs.items()
    }
    transfer = KVTransfer(npu_caches, dict.fromkeys(npu_caches, settings.num_host_blocks))
    block_bytes = transfer.block_bytes["full"]

    batches = []
    for num_blocks in settings.batch_blocks:
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for rep in range(-1, settings.repeats):  # repetition -1 warms up, unrecorded
            variants = _variants(transfer, num_blocks, rng)
            for name in rotated(VARIANTS, rep):
                seconds = _clock(variants[name], where)
                if rep >= 0:
                    samples[name].append(seconds)
        seconds = {v: median(samples[v]) for v in VARIANTS}
        num_bytes = num_blocks * block_bytes
        batches.append(
            {
                "num_blocks": num_blocks,
                "bytes": num_bytes,
                "median_s": seconds,
                "gib_per_s": {v: num_bytes / seconds[v] / 2**30 for v in VARIANTS},
                "ratios": {
                    "store_over_contiguous": seconds["contiguous"] / seconds["store"],
                    "load_over_contiguous": seconds["contiguous"] / seconds["load"],
                    "gather_plus_scatter_over_store": (seconds["gather"] + seconds["scatter"])
                    / seconds["store"],
                },
                "samples_s": samples,
            }
        )
        print(f"{num_blocks} blocks done", flush=True)
    report = _report(settings, batches, block_bytes, command, quick)
    report.results["device"] = str(where)
    if where.type == "cuda":
        report.results["gpu"] = torch.cuda.get_device_name(where)
        report.sections.append(
            f"Measured on {torch.cuda.get_device_name(where)}: the NPU pools are on the GPU and "
            "the host pools are pinned. `KVTransfer` gathers on the device and copies through "
            "pinned staging blocks allocated at start-up (a store then scatters them into the "
            "host pool once landed; a load gathers into them before the copy up)."
        )
    return report.write(output_dir)


def _report(
    settings: Settings, batches: list[dict], block_bytes: int, command: str, quick: bool
) -> Report:
    report = Report(
        NAME,
        "KV block transfer throughput: KVTransfer vs one contiguous copy",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        f"Throughput (GiB/s, median of {settings.repeats}); block = {block_bytes} bytes",
        ["blocks", "MiB", *VARIANTS],
        [
            [b["num_blocks"], b["bytes"] / 2**20, *(b["gib_per_s"][v] for v in VARIANTS)]
            for b in batches
        ],
    )
    rows = []
    for b in batches:
        store, load = b["ratios"]["store_over_contiguous"], b["ratios"]["load_over_contiguous"]
        halves = b["ratios"]["gather_plus_scatter_over_store"]
        rows.append([b["num_blocks"], store, store >= TARGET, load, load >= TARGET, halves])
    report.add_table(
        f"Throughput relative to the contiguous copy (target >= {TARGET})",
        ["blocks", "store", "target", "load", "target", "(gather + scatter) / store time"],
        rows,
    )
    report.sections.append(
        "How `KVTransfer` copies on CPU: every block goes straight from its source to its "
        "destination in one fused `_foreach_copy_` call per cache type and direction. The "
        "*gather*, *gather_prealloc* and *scatter* columns show what a staging design would "
        "cost instead: a gather into a staging tensor plus a scatter out of it moves every "
        "byte twice (the last column), and a freshly allocated staging tensor also faults on "
        "every page at first touch (compare *gather* with *gather_prealloc*)."
    )
    figure, (left, right) = new_figure(2)
    sizes = [b["num_blocks"] for b in batches]
    for variant in VARIANTS:
        left.plot(sizes, [b["gib_per_s"][variant] for b in batches], marker="o", label=variant)
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [str(n) for n in sizes])
    left.set_xlabel("blocks per batch")
    left.set_ylabel("GiB/s")
    left.legend()
    for key in ("store_over_contiguous", "load_over_contiguous"):
        right.plot(sizes, [b["ratios"][key] for b in batches], marker="o", label=key)
    right.axhline(TARGET, linestyle="--", color="black", linewidth=0.8, label="target")
    right.set_xscale("log", base=2)
    right.set_xticks(sizes, [str(n) for n in sizes])
    right.set_xlabel("blocks per batch")
    right.set_ylabel("throughput / contiguous copy")
    right.legend()
    report.figures["transfer.png"] = figure
    report.results = {
        "settings": asdict(settings),
        "block_bytes": block_bytes,
        "torch_num_threads": torch.get_num_threads(),
        "batches": batches,
    }
    return report
