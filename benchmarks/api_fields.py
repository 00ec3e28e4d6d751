"""api-fields: what prefix caching buys the OpenAI fields that share a prompt.

1. ``n = 8`` choices of one prompt against 8 separate requests of it sent together: prompt
   tokens computed and time to first token (each choice's), one engine each, sampled.
2. An evaluation workload as lm-evaluation-harness sends it: for each of ``num_docs``
   multiple-choice questions behind one few-shot prefix, one request per choice with
   ``max_tokens=1`` and prompt logprobs (``echo`` + ``logprobs``), one request at a time
   (``num_concurrent=1``). Total time with prefix caching on against off; the accuracy (from
   the prompt logprobs) must be the same.
"""

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.report import Report, new_figure
from benchmarks.workload import prompt_vocab, random_tokens
from cluster import LLM, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.model.resolve import DEFAULT_MODEL as REAL_MODEL

NAME = "api-fields"
EVAL_SPEEDUP_TARGET = 3.0


@dataclass(frozen=True, slots=True)
class Settings:
    prompt_len: int = 512
    num_choices: int = 8
    max_tokens: int = 16
    fewshot_len: int = 768
    question_len: int = 24
    choice_len: int = 4
    num_docs: int = 16
    num_options: int = 4
    seed: int = 0


QUICK = Settings(prompt_len=64, num_choices=2, max_tokens=2, fewshot_len=64, num_docs=2)


def _llm(model: str, settings: Settings, caching: bool = True) -> LLM:
    return LLM(
        model,
        scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=caching)),
    )


def _choices(model: str, settings: Settings, prompt: list[int]) -> dict[str, dict]:
    sampled = SamplingParams(max_tokens=settings.max_tokens, temperature=1.0, ignore_eos=True)
    result = {}
    for name in ("n", "separate"):
        with _llm(model, settings) as llm:
            llm.generate(prompt[:8], SamplingParams(max_tokens=1))  # warm-up
            before = llm.engine.core.num_scheduled_tokens
            start = time.monotonic()
            if name == "n":
                params = SamplingParams(**{**_fields(sampled), "n": settings.num_choices})
                outputs = llm.generate(prompt, params)
            else:
                outputs = llm.generate([prompt] * settings.num_choices, sampled)
            elapsed = time.monotonic() - start
            computed = llm.engine.core.num_scheduled_tokens - before
            decode = settings.num_choices * (settings.max_tokens - 1)
            ttfts = sorted(o.ttft_s for o in outputs)
            result[name] = {
                "prompt_tokens_computed": computed - decode,
                "ttft_mean_s": sum(ttfts) / len(ttfts),
                "ttft_max_s": ttfts[-1],
                "total_s": elapsed,
            }
    return result


def _evaluation(model: str, settings: Settings, rng: random.Random) -> dict[str, dict]:
    result = {}
    with _llm(model, settings) as probe:
        vocab = prompt_vocab(probe)
    fewshot = random_tokens(rng, settings.fewshot_len, vocab)
    docs = [
        (
            random_tokens(rng, settings.question_len, vocab),
            [random_tokens(rng, settings.choice_len, vocab) for _ in range(settings.num_options)],
        )
        for _ in range(settings.num_docs)
    ]
    score = SamplingParams(max_tokens=1, prompt_logprobs=1)
    for name, caching in (("caching off", False), ("caching on", True)):
        with _llm(model, settings, caching) as llm:
            llm.generate(fewshot[:8], SamplingParams(max_tokens=1))  # warm-up
            picks = []
            start = time.monotonic()
            for question, options in docs:
                context = fewshot + question
                scores = []
                for option in options:
                    output = llm.generate(context + option, score)
                    scores.append(sum(s.logprob for s in output.prompt_logprobs[len(context) :]))
                picks.append(max(range(len(scores)), key=scores.__getitem__))
            elapsed = time.monotonic() - start
            stats = llm.stats().cache
            result[name] = {
                "total_s": elapsed,
                "picks": picks,
                "hit_rate": stats.hits / max(1, stats.queries),
            }
    return result


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = REAL_MODEL
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    if quick and model == REAL_MODEL:
        model = "tiny"  # a smoke test of the code path, not figures
    rng = random.Random(settings.seed)
    with _llm(model, settings) as probe:
        vocab = prompt_vocab(probe)
    prompt = random_tokens(rng, settings.prompt_len, vocab)
    choices = _choices(model, settings, prompt)
    evaluation = _evaluation(model, settings, rng)
    ratios = {
        "n_over_separate_prompt_tokens": choices["n"]["prompt_tokens_computed"]
        / choices["separate"]["prompt_tokens_computed"],
        "n_over_separate_ttft_mean": choices["n"]["ttft_mean_s"]
        / choices["separate"]["ttft_mean_s"],
        "eval_speedup_caching_on": evaluation["caching off"]["total_s"]
        / evaluation["caching on"]["total_s"],
    }
    same_picks = evaluation["caching off"]["picks"] == evaluation["caching on"]["picks"]
    report = Report(
        NAME,
        f"n choices and an evaluation workload with prefix caching, model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        f"{settings.num_choices} choices of one {settings.prompt_len}-token prompt, "
        f"{settings.max_tokens} tokens each",
        ["", "prompt tokens computed", "mean TTFT (ms)", "max TTFT (ms)", "total (s)"],
        [
            [name, c["prompt_tokens_computed"], 1e3 * c["ttft_mean_s"], 1e3 * c["ttft_max_s"]]
            + [c["total_s"]]
            for name, c in choices.items()
        ],
    )
    report.add_table(
        f"{settings.num_docs} questions x {settings.num_options} choices behind a "
        f"{settings.fewshot_len}-token few-shot prefix, one request at a time",
        ["", "total (s)", "hit rate"],
        [[name, e["total_s"], e["hit_rate"]] for name, e in evaluation.items()],
    )
    speedup = ratios["eval_speedup_caching_on"]
    report.add_table(
        "Ratios",
        ["ratio", "value", "target", "met"],
        [
            ["n / separate: prompt tokens computed", ratios["n_over_separate_prompt_tokens"]]
            + ["", ""],
            ["n / separate: mean TTFT", ratios["n_over_separate_ttft_mean"], "", ""],
            ["evaluation: off / on total time", speedup, f">= {EVAL_SPEEDUP_TARGET}"]
            + ["pass" if speedup >= EVAL_SPEEDUP_TARGET else "FAIL"],
            ["same answers with caching on and off", same_picks, "True", str(same_picks)],
        ],
    )
    report.figures["api_fields.png"] = _plot(choices, evaluation)
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "choices": choices,
        "evaluation": {k: {**v, "picks": len(v["picks"])} for k, v in evaluation.items()},
        "same_picks": same_picks,
        "ratios": ratios,
    }
    return report.write(output_dir)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def _plot(choices: dict[str, dict], evaluation: dict[str, dict]):
    figure, (left, right) = new_figure(2)
    names = list(choices)
    left.bar(names, [choices[n]["prompt_tokens_computed"] for n in names])
    left.set_title("choices of one prompt")
    left.set_ylabel("prompt tokens computed")
    names = list(evaluation)
    right.bar(names, [evaluation[n]["total_s"] for n in names])
    right.set_title("evaluation workload")
    right.set_ylabel("total time (s)")
    return figure
