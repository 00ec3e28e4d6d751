"""decode: output tokens/s of Strata vs transformers' generate on the same weights, by batch.

Each request is a prompt of ``prompt_len`` random token ids and ``output_len`` greedy output
tokens, EOS ignored. Strata (``cluster.LLM`` in this process) and transformers (``generate``,
``do_sample=False``, ``min_new_tokens = max_new_tokens``, on the model loaded from the same
GGUF file or directory) run the same prompts, all of one length so that transformers pads
nothing, in the same dtype and with the same torch threads. In every repetition and batch size,
each (engine, dtype) pair runs once, in an order that rotates; medians are reported.
*Output tok/s* counts every output token over the whole call (the batch's prefill included);
*decode tok/s* counts the tokens after the first over the time after the batch's first token.
The batch-1 decode rate is compared with the weight-bandwidth limit: the memory copy bandwidth
(bytes read plus written by the best of several copies of a large tensor, measured at every
repetition) over the bytes of weights one decode step reads (every parameter in that dtype,
the embedding table left out when it is only gathered and counted when it is the tied LM head).
"""

import copy
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import nn

from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    BLOCK_SIZE,
    build_llm,
    median,
    prompt_vocab,
    random_tokens,
    rotated,
)
from cluster import LLM, SamplingParams, SchedulerConfig
from replicas.dtypes import torch_dtype
from replicas.model.resolve import resolve_model

NAME = "decode"
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DTYPES = ("float32", "bfloat16")
ENGINES = ("strata", "transformers")


@dataclass(frozen=True, slots=True)
class Settings:
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 32
    output_len: int = 64
    repeats: int = 5
    warmup_repeats: int = 1  # whole rounds run first and not recorded
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    copy_mib: int = 256
    copies_per_repeat: int = 3
    seed: int = 0


QUICK = Settings(
    output_len=4, repeats=1, warmup_repeats=0, dtypes=("float32",), copy_mib=64, copies_per_repeat=2
)


@dataclass(slots=True)
class Timing:
    total_s: float  # the whole call
    decode_s: float  # from the batch's first token (every request has one) to the end
    token_ids: list[list[int]]  # output tokens of each request


def weight_bytes_per_token(model: nn.Module, embedding: nn.Module, lm_head: nn.Module) -> int:
    """Bytes of parameters one decode step reads: all of them (a tied embedding and LM head
    once), but the embedding table not at all when it is only gathered (not tied)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if embedding.weight is not lm_head.weight:
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


def copy_seconds(source: torch.Tensor, target: torch.Tensor, copies: int) -> float:
    """The fastest of ``copies`` copies of ``source`` into ``target`` (both already touched)."""
    best = float("inf")
    for _ in range(copies):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


def load_reference(model: str) -> nn.Module:
    """transformers' model of ``model`` in float32, from the file or directory Strata loads."""
    path = Path(resolve_model(model))
    if not path.exists():
        raise ValueError(
            f"the decode scenario compares with transformers, which needs real weights; "
            f"'{model}' has none on disk (use --model smollm2-135m, a .gguf file or a "
            "Hugging Face directory)"
        )
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if path.is_file():
            reference = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
        else:
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        hf_logging.enable_progress_bar()
    reference.eval()
    reference.requires_grad_(False)
    return reference


def run_strata(llm: LLM, prompts: list[list[int]], output_len: int) -> Timing:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.monotonic()  # the engine stamps first tokens with time.monotonic too
    outputs = llm.generate(prompts, params)
    end = time.monotonic()
    for output in outputs:
        if len(output.token_ids) != output_len or output.num_cached_tokens:
            raise RuntimeError(
                f"Strata request {output.request_id}: {len(output.token_ids)} output tokens "
                f"(expected {output_len}), {output.num_cached_tokens} prompt tokens cached "
                "(expected 0)"
            )
    first = max(output.first_token_time for output in outputs)
    return Timing(end - start, end - first, [list(output.token_ids) for output in outputs])


class _FirstLogits:
    """A logits processor that notes when it is first called: right after the prefill."""

    def __init__(self) -> None:
        self.time: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.time is None:
            self.time = time.monotonic()
        return scores


def run_transformers(reference: nn.Module, prompts: list[list[int]], output_len: int) -> Timing:
    from transformers import GenerationConfig, LogitsProcessorList

    input_ids = torch.tensor(prompts, dtype=torch.long)
    eos = reference.config.eos_token_id
    config = GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if isinstance(eos, int) else eos[0],
    )
    first = _FirstLogits()
    start = time.monotonic()
    output = reference.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=config,
        logits_processor=LogitsProcessorList([first]),
    )
    end = time.monotonic()
    new = output[:, input_ids.shape[1] :]
    if new.shape[1] != output_len:
        raise RuntimeError(f"transformers made {new.shape[1]} output tokens, not {output_len}")
    return Timing(end - start, end - first.time, new.tolist())


def _rates(timings: list[Timing], batch: int, output_len: int) -> dict[str, object]:
    output = [batch * output_len / t.total_s for t in timings]
    decode = [batch * (output_len - 1) / t.decode_s for t in timings]
    return {
        "output_tokens_per_s": median(output),
        "decode_tokens_per_s": median(decode),
        "output_tokens_per_s_samples": output,
        "decode_tokens_per_s_samples": decode,
        "total_s_samples": [t.total_s for t in timings],
        "decode_s_samples": [t.decode_s for t in timings],
    }


def _agreement(strata: list[Timing], reference: list[Timing]) -> dict[str, float]:
    """How often both engines chose the same greedy tokens for the same prompt."""
    same, prefix = [], []
    for ours, theirs in zip(strata, reference):
        for a, b in zip(ours.token_ids, theirs.token_ids):
            same.append(float(a == b))
            common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            prefix.append(common / len(a))
    return {"same_output": statistics.fmean(same), "common_prefix": statistics.fmean(prefix)}


def run(
    output_dir: Path,
    *,
    quick: bool,
    command: str,
    model: str = DEFAULT_MODEL,
    dtypes: list[str] | None = None,
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    if dtypes:
        settings = replace(settings, dtypes=tuple(dict.fromkeys(dtypes)))
    if settings.output_len < 2:
        raise ValueError("the decode scenario needs at least 2 output tokens")
    budget = SchedulerConfig().max_num_batched_tokens
    if max(settings.batch_sizes) * settings.prompt_len > budget:
        raise ValueError(f"the largest batch's prompts must fit one step of {budget} tokens")
    # Loaded once in float32, then cast to each other dtype.
    loaded = load_reference(model)
    references = {
        dtype: loaded if dtype == "float32" else copy.deepcopy(loaded).to(torch_dtype(dtype))
        for dtype in settings.dtypes
    }
    del loaded
    seq_blocks = -(-(settings.prompt_len + settings.output_len) // BLOCK_SIZE)
    llms = {
        dtype: build_llm(
            num_npu_blocks=max(settings.batch_sizes) * seq_blocks + 2 * BLOCK_SIZE,
            max_model_len=settings.prompt_len + settings.output_len + BLOCK_SIZE,
            model=model,
            dtype=dtype,
            quantization="none",  # the weights transformers runs (engine-vs-llamacpp: quantized)
        )
        for dtype in settings.dtypes
    }
    first_llm = next(iter(llms.values()))
    vocab = min(prompt_vocab(first_llm), references[settings.dtypes[0]].config.vocab_size)

    weight_bytes = {}
    for dtype in settings.dtypes:
        ours, theirs = llms[dtype].engine.loaded.model, references[dtype]
        weight_bytes[dtype] = {
            "strata": weight_bytes_per_token(ours, ours.tok_embeddings, ours.output),
            "transformers": weight_bytes_per_token(
                theirs, theirs.get_input_embeddings(), theirs.get_output_embeddings()
            ),
        }
    copy_elements = settings.copy_mib * 2**20 // 4
    source = torch.rand(copy_elements)
    target = torch.zeros(copy_elements)
    copy_samples: list[float] = []

    variants = [(dtype, engine) for dtype in settings.dtypes for engine in ENGINES]
    timings: dict[tuple[str, int, str], list[Timing]] = {
        (dtype, batch, engine): []
        for dtype in settings.dtypes
        for batch in settings.batch_sizes
        for engine in ENGINES
    }
    rng = random.Random(settings.seed)
    for rep in range(-settings.warmup_repeats, settings.repeats):
        copy_samples.append(copy_seconds(source, target, settings.copies_per_repeat))
        for b, batch in enumerate(settings.batch_sizes):
            prompts = [random_tokens(rng, settings.prompt_len, vocab) for _ in range(batch)]
            for dtype, engine in rotated(variants, rep + b):
                with torch.inference_mode():
                    if engine == "strata":
                        timing = run_strata(llms[dtype], prompts, settings.output_len)
                    else:
                        timing = run_transformers(references[dtype], prompts, settings.output_len)
                if rep >= 0:
                    timings[(dtype, batch, engine)].append(timing)
        label = "warm-up" if rep < 0 else f"repetition {rep + 1}/{settings.repeats}"
        print(f"{label} done", flush=True)
    for llm in llms.values():
        llm.check_integrity()

    copy_bytes = 2 * source.numel() * source.element_size()  # read + written
    bandwidth = copy_bytes / min(copy_samples)
    runs, per_dtype = [], []
    for dtype in settings.dtypes:
        weights = weight_bytes[dtype]["strata"]
        limit = bandwidth / weights
        per_dtype.append(
            {
                "dtype": dtype,
                "weight_bytes_per_token": weights,
                "transformers_weight_bytes_per_token": weight_bytes[dtype]["transformers"],
                "weight_limit_tokens_per_s": limit,
            }
        )
        for batch in settings.batch_sizes:
            entry: dict[str, object] = {"dtype": dtype, "batch_size": batch}
            for engine in ENGINES:
                rates = _rates(timings[(dtype, batch, engine)], batch, settings.output_len)
                # A decode step reads the weights once for the whole batch.
                rates["steps_over_weight_limit"] = rates["decode_tokens_per_s"] / batch / limit
                entry[engine] = rates
            strata, reference = entry["strata"], entry["transformers"]
            entry["strata_over_transformers"] = {
                key: strata[f"{key}_tokens_per_s"] / reference[f"{key}_tokens_per_s"]
                for key in ("output", "decode")
            }
            entry["agreement"] = _agreement(
                timings[(dtype, batch, "strata")], timings[(dtype, batch, "transformers")]
            )
            runs.append(entry)

    report = Report(
        NAME,
        f"Decode throughput: Strata vs transformers generate, model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        f"Median tokens/s over {settings.repeats} interleaved repetitions "
        f"({settings.prompt_len}-token prompts, {settings.output_len} output tokens each, "
        f"{torch.get_num_threads()} torch threads)",
        ["dtype", "batch", "Strata output", "transformers output", "Strata / transformers"]
        + ["Strata decode", "transformers decode", "Strata / transformers", "same tokens"],
        [
            [r["dtype"], r["batch_size"]]
            + [r["strata"]["output_tokens_per_s"], r["transformers"]["output_tokens_per_s"]]
            + [r["strata_over_transformers"]["output"]]
            + [r["strata"]["decode_tokens_per_s"], r["transformers"]["decode_tokens_per_s"]]
            + [r["strata_over_transformers"]["decode"], r["agreement"]["same_output"]]
            for r in runs
        ],
    )
    batch_one = {r["dtype"]: r for r in runs if r["batch_size"] == 1}
    if batch_one:
        report.add_table(
            f"Batch 1 against the weight-bandwidth limit (copy bandwidth "
            f"{bandwidth / 2**30:.1f} GiB/s, read + written, best of "
            f"{len(copy_samples) * settings.copies_per_repeat} copies of "
            f"{settings.copy_mib} MiB)",
            ["dtype", "weights read / token (MiB)", "limit (tok/s)"]
            + ["Strata decode (tok/s)", "Strata / limit"]
            + ["transformers decode (tok/s)", "transformers / limit"],
            [
                [d["dtype"], d["weight_bytes_per_token"] / 2**20, d["weight_limit_tokens_per_s"]]
                + [batch_one[d["dtype"]]["strata"]["decode_tokens_per_s"]]
                + [batch_one[d["dtype"]]["strata"]["steps_over_weight_limit"]]
                + [batch_one[d["dtype"]]["transformers"]["decode_tokens_per_s"]]
                + [batch_one[d["dtype"]]["transformers"]["steps_over_weight_limit"]]
                for d in per_dtype
            ],
        )
    report.sections.append(_verdicts(runs, settings))
    report.figures["decode.png"] = _plot(settings, runs, per_dtype)
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "torch_threads": torch.get_num_threads(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "copy_bytes": copy_bytes,
        "copy_samples_s": copy_samples,
        "dtypes": per_dtype,
        "runs": runs,
    }
    return report.write(output_dir)


def _verdicts(runs: list[dict], settings: Settings) -> str:
    lines = []
    slower = [
        f"{r['dtype']} batch {r['batch_size']} ({key} {r['strata_over_transformers'][key]:.2f}x)"
        for r in runs
        for key in ("output", "decode")
        if r["strata_over_transformers"][key] < 1
    ]
    if slower:
        lines.append("Strata is slower than transformers at: " + ", ".join(slower) + ".")
    else:
        lines.append("Strata is at least as fast as transformers at every point measured.")
    if len(settings.dtypes) > 1:
        for batch in settings.batch_sizes:
            rates = {
                r["dtype"]: r["strata"]["decode_tokens_per_s"]
                for r in runs
                if r["batch_size"] == batch
            }
            best = max(rates, key=rates.get)
            others = ", ".join(f"{d} {v:.3g}" for d, v in rates.items() if d != best)
            lines.append(
                f"Strata batch {batch}: {best} decodes fastest ({rates[best]:.3g} tok/s; {others})."
            )
    lines.append(
        "*same tokens* is the share of requests whose greedy outputs are identical in both "
        "engines; rounding differences (most in bfloat16) may flip a near-tie and change the "
        "rest of that output."
    )
    return "\n\n".join(lines)


def _plot(settings: Settings, runs: list[dict], per_dtype: list[dict]) -> Figure:
    figure, (left, right) = new_figure(2)
    batches = list(settings.batch_sizes)
    for index, d in enumerate(per_dtype):
        dtype, color = d["dtype"], f"C{index}"
        rows = [r for r in runs if r["dtype"] == dtype]
        for engine, style in (("strata", "o-"), ("transformers", "s-.")):
            left.plot(
                batches,
                [r[engine]["decode_tokens_per_s"] for r in rows],
                style,
                color=color,
                label=f"{engine} {dtype}",
            )
        left.plot(
            batches,
            [b * d["weight_limit_tokens_per_s"] for b in batches],
            "--",
            linewidth=0.8,
            color=color,
            label=f"weight-read limit {dtype}",
        )
        for key, style in (("decode", "o-"), ("output", "s:")):
            right.plot(
                batches,
                [r["strata_over_transformers"][key] for r in rows],
                style,
                color=color,
                label=f"{key} {dtype}",
            )
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.set_xlabel("batch size")
    left.set_yscale("log")
    left.set_ylabel("median decode tokens/s (log)")
    left.set_title("decode throughput (dashed: batch x weight-read limit)")
    left.legend(fontsize="small")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_ylabel("Strata / transformers (tokens/s)")
    right.set_title("Strata relative to transformers")
    right.legend(fontsize="small")
    return figure
