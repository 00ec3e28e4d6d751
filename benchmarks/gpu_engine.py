"""gpu-engine: CUDA decode and prefill at a real model size against the device's limits.

First the device's own ceilings are measured: copy bandwidth (bytes read and written by one
device-to-device copy), pinned host<->device GiB/s and bfloat16 matrix-product TFLOP/s. Then
the model (default ``llama3-8b-shape``: Llama-3-8B's shapes, random bfloat16 weights) runs in
Strata's ``ModelRunner`` with the paged attention kernels and decode CUDA graphs:

- decode ms/step at each batch size and context, a step being the batch's copy to the device,
  the graph's replay and the sampled tokens' copy back (what the engine waits for); against the
  bandwidth ceiling ``(weight bytes + KV bytes read) / copy bandwidth``; and the same step run
  eagerly (every kernel launched from Python);
- kernels launched per decode step (profiled), and the GPU-busy share of a step (the replay's
  GPU time over the step's wall time);
- cold prefill of one prompt as a share of the measured bfloat16 peak (products' and
  attention's FLOPs).

Every KV position read is real cache memory (random blocks per sequence); the values are zeros,
which costs attention what any values cost. ``python -m benchmarks.gpu_engine`` runs it where
the rest of the benchmarks' dependencies (Ray, FastAPI) are absent, as on a bare GPU image.
"""

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.report import Report, new_figure
from replicas.engine.cuda_batch import HostBatch
from replicas.engine.model_runner import ModelRunner
from replicas.model import load_model

NAME = "gpu-engine"
BLOCK_SIZE = 16
TARGETS = {"decode_b32_1k": 1.4, "decode_b32_8k": 1.6, "decode_b1": 1.5, "prefill_8k": 0.5}


@dataclass(frozen=True, slots=True)
class Settings:
    model: str = "llama3-8b-shape"
    batches: tuple[int, ...] = (1, 32)
    contexts: tuple[int, ...] = (1024, 8192)
    prefills: tuple[int, ...] = (2048, 8192)
    prefill_chunk: int = 2048  # also measured in chunks of this many tokens (the paged kernels)
    steps: int = 20
    seed: int = 0


QUICK = Settings(
    model="tiny", batches=(1, 2), contexts=(64, 160), prefills=(128,), prefill_chunk=48, steps=2
)


def _clock(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, synchronized."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ceilings(device: torch.device, quick: bool) -> dict[str, float]:
    """The device's measured limits: copy GB/s (read + written), pinned copies, bf16 TFLOP/s."""
    size = (2**24 if quick else 2**30) // 2  # bfloat16 elements: 16 MiB or 1 GiB
    src = torch.randn(size, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = _clock(lambda: dst.copy_(src), device, 5 if quick else 20)
    out = {"copy_gb_per_s": 2 * src.numel() * 2 / copy_s / 1e9}
    if device.type == "cuda":
        host = torch.empty(size, dtype=torch.bfloat16).pin_memory()
        out["h2d_gib_per_s"] = 2 * size / _clock(lambda: src.copy_(host), device, 5) / 2**30
        out["d2h_gib_per_s"] = 2 * size / _clock(lambda: host.copy_(src), device, 5) / 2**30
    n = 256 if quick or device.type != "cuda" else 8192
    a = torch.randn((n, n), device=device, dtype=torch.bfloat16)
    b = torch.randn((n, n), device=device, dtype=torch.bfloat16)
    matmul_s = _clock(lambda: a @ b, device, 3 if quick else 10)
    out["bf16_tflop_per_s"] = 2 * n**3 / matmul_s / 1e12
    return out


def _host_decode(batch: int, context: int, ids: torch.Tensor, group: str) -> HostBatch:
    """``batch`` sequences of ``context`` keys each on their own blocks, each decoding one."""
    per_seq = -(-context // BLOCK_SIZE)
    rows = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    position = context - 1
    slots = [r[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE for r in rows]
    return HostBatch(
        input_ids=ids[:batch].tolist(),
        positions=[position] * batch,
        query_start_loc=list(range(batch + 1)),
        seq_lens=[context] * batch,
        block_rows=[{group: r} for r in rows],
        slots={group: slots},
        logits_indices=list(range(batch)),
        num_solo_seqs=0,
    )


def _host_prefill(end: int, ids: torch.Tensor, group: str, start: int = 0) -> HostBatch:
    """One prompt's tokens ``start:end``, after ``start`` cached ones."""
    blocks = list(range(1, 1 + -(-end // BLOCK_SIZE)))
    return HostBatch(
        input_ids=ids[start:end].tolist(),
        positions=list(range(start, end)),
        query_start_loc=[0, end - start],
        seq_lens=[end],
        block_rows=[{group: blocks}],
        slots={
            group: [
                blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
        },
        logits_indices=[end - start - 1],
        num_solo_seqs=0,
    )


def _prefill(runner: ModelRunner, length: int, chunk: int, ids, group: str) -> float:
    """Seconds to prefill ``length`` tokens in chunks of ``chunk`` (the later chunks attend
    to the earlier ones through the paged kernels)."""
    hosts = [
        _host_prefill(min(start + chunk, length), ids, group, start)
        for start in range(0, length, chunk)
    ]

    def prefill() -> None:
        for host in hosts:
            _eager_logits(runner, host).argmax(-1).tolist()

    return _clock(prefill, runner.device, 3)


def _eager_logits(runner: ModelRunner, host: HostBatch) -> torch.Tensor:
    batch = runner._batch(host)
    hidden = runner.model(batch, runner.kv_caches, runner.kv_format)
    return runner.model.compute_logits(hidden[batch.logits_indices])


def _decode_row(runner: ModelRunner, host: HostBatch, settings: Settings, device) -> dict:
    """Graph and eager step times of one (batch, context), and the replay's GPU time."""

    def graph_step() -> list[int]:
        return runner.graphs.run(host).argmax(-1).tolist()

    def eager_step() -> list[int]:
        return _eager_logits(runner, host).argmax(-1).tolist()

    row = {"eager_ms": 1e3 * _clock(eager_step, device, settings.steps)}
    if runner.graphs is None or not runner.graphs.can_run(host):
        return row
    graph_tokens, eager_tokens = graph_step(), eager_step()
    row["graph_tokens_equal_eager"] = graph_tokens == eager_tokens
    row["step_ms"] = 1e3 * _clock(graph_step, device, settings.steps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(settings.steps):
        start.record()
        runner.graphs.run(host)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    row["replay_gpu_ms"] = statistics.median(gpu)
    row["gpu_busy_share"] = row["replay_gpu_ms"] / row["step_ms"]
    return row


def _launches(runner: ModelRunner, host: HostBatch, graphs: bool) -> dict[str, int]:
    """Kernels and graphs the host launches for one decode step (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    step = (lambda: runner.graphs.run(host)) if graphs else (lambda: _eager_logits(runner, host))
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return {
        "kernel_launches": sum("LaunchKernel" in n for n in names),
        "graph_launches": sum("GraphLaunch" in n for n in names),
        "memcpy_calls": sum(n.startswith("cudaMemcpy") for n in names),
    }


def _weights_read(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: all but the embedding table (a few rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.tok_embeddings.weight
    tied = model.output.weight is embedding if hasattr(model.output, "weight") else False
    return total if tied else total - embedding.numel() * embedding.element_size()


def _prefill_flops(model, length: int) -> float:
    args = model.args
    linear = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "layers." in name
    )
    attention = 2 * length * length * args.num_heads * args.head_dim * args.num_layers
    return 2 * length * linear + attention + 2 * args.vocab_size * args.hidden_size


def _decode(runner, settings, shape, ids, group, sizes, bandwidth: float) -> dict:
    """One decode row: (batch, context) ``shape``; ``sizes``: (weight bytes, KV bytes a token)."""
    batch, context = shape
    host = _host_decode(batch, context, ids, group)
    row = {"batch": batch, "context": context}
    row.update(_decode_row(runner, host, settings, runner.device))
    row["ceiling_ms"] = 1e3 * (sizes[0] + batch * context * sizes[1]) / bandwidth
    row["step_over_ceiling"] = row.get("step_ms", row["eager_ms"]) / row["ceiling_ms"]
    print(f"gpu-engine decode {row}", flush=True)
    return row


def _prefill_row(runner, length: int, chunk: int, ids, group: str, peak: float) -> dict:
    seconds = _prefill(runner, length, chunk, ids, group)
    tflops = _prefill_flops(runner.model, length) / seconds / 1e12
    row = {
        "tokens": length,
        "chunk": chunk,
        "ms": 1e3 * seconds,
        "tflop_per_s": tflops,
        "share_of_peak": tflops / peak,
    }
    print(f"gpu-engine prefill {row}", flush=True)
    return row


def measure(settings: Settings, device: torch.device, quick: bool) -> dict[str, object]:
    limits = ceilings(device, quick)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loaded = load_model(settings.model, device, dtype, seed=settings.seed)
    model = loaded.model
    spec = next(iter(model.kv_cache_specs(dtype).values()))
    group = spec.group
    longest = max(max(settings.contexts), max(settings.prefills))
    blocks = max(settings.batches) * (-(-max(settings.contexts) // BLOCK_SIZE)) + 8
    blocks = max(blocks, -(-longest // BLOCK_SIZE) + 8)
    started = time.perf_counter()
    runner = ModelRunner(
        loaded,
        {g: blocks for g in model.kv_cache_specs(dtype)},
        BLOCK_SIZE,
        device,
        dtype,
        max_num_seqs=max(settings.batches),
        max_model_len=longest + BLOCK_SIZE,
    )
    set_up_s = time.perf_counter() - started
    ids = torch.randint(0, 256, (longest,), generator=torch.Generator().manual_seed(0))
    weight_bytes = _weights_read(model)
    kv_per_token = spec.block_bytes(BLOCK_SIZE) // BLOCK_SIZE
    bandwidth = limits["copy_gb_per_s"] * 1e9
    decodes = [
        _decode(runner, settings, (batch, context), ids, group, (weight_bytes, kv_per_token),
                bandwidth)
        for context in settings.contexts
        for batch in settings.batches
    ]  # fmt: skip
    launches = {}
    if device.type == "cuda":
        host = _host_decode(max(settings.batches), min(settings.contexts), ids, group)
        launches = {"eager": _launches(runner, host, graphs=False)}
        if runner.graphs is not None:
            launches["graph"] = _launches(runner, host, graphs=True)
    prefills = [
        _prefill_row(runner, length, chunk, ids, group, limits["bf16_tflop_per_s"])
        for length in settings.prefills
        for chunk in sorted({length, min(length, settings.prefill_chunk)}, reverse=True)
    ]
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": settings.model,
        "dtype": str(dtype).removeprefix("torch."),
        "ceilings": limits,
        "weight_bytes_read_per_step": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "runner_set_up_s": set_up_s,
        "decode": decodes,
        "launches_per_decode_step": launches,
        "prefill": prefills,
    }


def run(
    output_dir: Path,
    *,
    quick: bool,
    command: str,
    device: str | None = None,
    model: str | None = None,
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    if model is not None:
        settings = Settings(**{**asdict(settings), "model": model})
    where = torch.device(
        device if device not in (None, "auto") else "cuda" if torch.cuda.is_available() else "cpu"
    )
    results = measure(settings, where, quick)
    return _report(settings, results, command, quick).write(output_dir)


def _report(settings: Settings, results: dict, command: str, quick: bool) -> Report:
    report = Report(
        NAME,
        "The CUDA engine against the device's limits",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        "Measured ceilings",
        ["copy GB/s", "H2D GiB/s", "D2H GiB/s", "bf16 TFLOP/s"],
        [
            [
                results["ceilings"].get(k, float("nan"))
                for k in ("copy_gb_per_s", "h2d_gib_per_s", "d2h_gib_per_s", "bf16_tflop_per_s")
            ]
        ],
    )
    report.add_table(
        f"Decode ({settings.model}), ms per step",
        [
            "batch",
            "context",
            "graph step",
            "eager step",
            "ceiling",
            "step / ceiling",
            "GPU busy",
            "graph = eager tokens",
        ],
        [
            [
                r["batch"],
                r["context"],
                r.get("step_ms", "-"),
                r["eager_ms"],
                r["ceiling_ms"],
                r["step_over_ceiling"],
                r.get("gpu_busy_share", "-"),
                r.get("graph_tokens_equal_eager", "-"),
            ]
            for r in results["decode"]
        ],
    )
    report.add_table(
        "Cold prefill",
        ["tokens", "chunk", "ms", "TFLOP/s", "share of bf16 peak"],
        [
            [p["tokens"], p["chunk"], p["ms"], p["tflop_per_s"], p["share_of_peak"]]
            for p in results["prefill"]
        ],
    )
    report.figures["gpu-engine.png"] = _figure(results)
    report.results = {"settings": asdict(settings), "targets": TARGETS, **results}
    return report


def _figure(results: dict):
    """Decode step time against its ceiling per (batch, context); prefill share of peak."""
    figure, (left, right) = new_figure(2)
    rows = results["decode"]
    labels = [f"b{r['batch']} {r['context']}" for r in rows]
    positions = range(len(rows))
    left.bar(
        [p - 0.2 for p in positions],
        [r.get("step_ms", r["eager_ms"]) for r in rows],
        width=0.4,
        label="step",
    )
    left.bar(
        [p + 0.2 for p in positions],
        [r["ceiling_ms"] for r in rows],
        width=0.4,
        label="bandwidth ceiling",
    )
    left.set_xticks(list(positions), labels)
    left.set_ylabel("ms per decode step")
    left.legend()
    prefill = results["prefill"]
    right.bar(
        [f"{p['tokens']}/{p['chunk']}" for p in prefill], [p["share_of_peak"] for p in prefill]
    )
    right.set_xlabel("prompt tokens / chunk")
    right.set_ylabel("share of measured bf16 peak")
    return figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_engine")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/out/gpu-engine"))
    args = parser.parse_args(argv)
    command = " ".join(["python", "-m", "benchmarks.gpu_engine", *(argv or sys.argv[1:])])
    run(args.output, quick=args.quick, command=command, device=args.device, model=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
