"""prefix-ttft: TTFT of one long prompt computed cold vs with its prefix cached on the NPU tier.

Every prompt is the same prefix followed by a last block of fresh tokens, so a cached run
matches all blocks but the last and computes ``suffix_len`` tokens instead of ``prompt_len``.
Cold runs reset the prefix cache first. Cold and cached runs alternate (which goes first
rotates every repetition) and the report gives medians and their ratio.
"""

import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    build_llm,
    fit_length,
    median,
    model_context_len,
    prompt_vocab,
    random_tokens,
    rotated,
    timed_request,
)

NAME = "prefix-ttft"


@dataclass(frozen=True, slots=True)
class Settings:
    prompt_len: int = 2048
    suffix_len: int = BLOCK_SIZE  # the last block: fresh in every request
    repeats: int = 15


QUICK = Settings(prompt_len=512, repeats=3)


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = DEFAULT_MODEL
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    limit = model_context_len(model) - 8
    settings = replace(settings, prompt_len=fit_length(settings.prompt_len, limit))
    rng = random.Random(0)
    prefix_len = settings.prompt_len - settings.suffix_len
    num_blocks = -(-settings.prompt_len // BLOCK_SIZE)
    # Room for the cached prefix plus a running request: nothing is ever evicted.
    llm = build_llm(
        num_npu_blocks=2 * num_blocks + 8, max_model_len=settings.prompt_len + 8, model=model
    )
    vocab = prompt_vocab(llm)
    prefix = random_tokens(rng, prefix_len, vocab)

    samples: dict[str, list[float]] = {"cold": [], "cached": []}
    for rep in range(settings.repeats):
        # Repetition 0 runs cold first, so the prefix is cached before any cached run.
        for kind in rotated(["cold", "cached"], rep):
            if kind == "cold":
                llm.reset_prefix_cache("all")
            output = timed_request(llm, prefix + random_tokens(rng, settings.suffix_len, vocab))
            expected = 0 if kind == "cold" else prefix_len
            if output.num_cached_tokens != expected:
                raise RuntimeError(
                    f"{kind} run matched {output.num_cached_tokens} tokens, expected {expected}"
                )
            samples[kind].append(output.ttft_s)
    llm.check_integrity()

    cold, cached = median(samples["cold"]), median(samples["cached"])
    ratios = {
        "cached_over_cold": cached / cold,
        "speedup": cold / cached,
        "computed_fraction": settings.suffix_len / settings.prompt_len,
    }
    report = Report(
        NAME,
        f"Prefix cache TTFT: {settings.prompt_len}-token prompt, cold vs cached prefix, "
        f"model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        f"Median TTFT over {settings.repeats} interleaved repetitions",
        ["run", "tokens computed", "median TTFT (ms)", "min (ms)", "max (ms)"],
        [
            [kind, settings.prompt_len if kind == "cold" else settings.suffix_len]
            + [1e3 * f(samples[kind]) for f in (median, min, max)]
            for kind in ("cold", "cached")
        ],
    )
    report.add_table(
        "Ratios",
        ["cached / cold", "speedup (cold / cached)", "tokens computed cached / cold"],
        [[ratios["cached_over_cold"], ratios["speedup"], ratios["computed_fraction"]]],
    )
    report.sections.append(
        "A cached run still reads the whole prefix's KV in attention and pays the fixed cost of "
        "a step, so its TTFT falls by less than the share of tokens computed."
    )
    figure, (axis,) = new_figure()
    for kind, marker in (("cold", "o"), ("cached", "s")):
        values = [1e3 * s for s in samples[kind]]
        axis.plot(range(1, len(values) + 1), values, marker=marker, label=kind)
    axis.set_yscale("log")
    axis.set_xlabel("repetition")
    axis.set_ylabel("TTFT (ms, log)")
    axis.set_title(f"{settings.prompt_len}-token prompt, block {BLOCK_SIZE}")
    axis.legend()
    report.figures["ttft.png"] = figure
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "median_ttft_s": {"cold": cold, "cached": cached},
        "samples_s": samples,
        "ratios": ratios,
    }
    return report.write(output_dir)
