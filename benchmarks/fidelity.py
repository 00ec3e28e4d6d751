"""fidelity: Strata's greedy outputs against transformers' float load and llama.cpp on the same
GGUF file, and caching on against caching off for every engine and KV cache dtype.

*First divergence*: each held-out prompt of ``tests/data/fidelity_prompts.json`` (chat turns
rendered with the model's chat template, and plain text) is run greedily, alone, by
transformers (the GGUF file dequantized into float32 weights: the reference), by Strata's
default (``auto``), by Strata with each dtype and weight format ``auto`` chooses among, and by
llama.cpp (llama-cpp-python, when installed; its KV and activations as it computes them).
For each engine and prompt: the index of the first output token that differs from the
reference's, outputs ending at an end-of-generation token or after ``output_len`` tokens
(``None``: the whole output is the reference's), and there the reference's logit of its own
token minus that of the token taken (the *float margin*: small where the float model is near a
tie, which is where 8-bit activations and bfloat16 can move a greedy token).

*Caching on and off*: for each engine dtype and ``kv_cache_dtype``, the chat prompts behind a
long shared system prompt, run one after another with prefix caching on (the system prompt
and the template cached at block boundaries, the rest computed in chunks of
``max_num_batched_tokens``) and off; the table counts prompts whose greedy output differs.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.engine_vs_llamacpp import open_peer
from benchmarks.report import Report, new_figure
from cluster import LLM, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.model.resolve import packaged_model_path

NAME = "fidelity"
DEFAULT_MODEL = "smollm2-135m"
PROMPTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "fidelity_prompts.json"
# (dtype, quantization, int4_kernel): Strata's default, then the candidates it picks among.
VARIANTS = (
    ("auto", "auto", "auto"),
    ("float32", "none", "auto"),
    ("bfloat16", "none", "auto"),
    ("float32", "int8", "auto"),
    ("float32", "int4", "torch"),
    ("float32", "int4", "strata"),
    ("bfloat16", "int4", "torch"),
    ("bfloat16", "int4", "strata"),
)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
SYSTEM = (
    "You are a patient tutor for curious people of every age. Answer in plain words, give one "
    "concrete example when it helps, and keep each answer short: three sentences at most. If a "
    "question is ambiguous, answer the most likely reading and say which one you chose."
)


@dataclass(frozen=True, slots=True)
class Settings:
    output_len: int = 48
    num_prompts: int | None = None  # None: all
    variants: tuple[tuple[str, str, str], ...] = VARIANTS
    cache_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    cache_kv_dtypes: tuple[str, ...] = KV_CACHE_DTYPES
    cache_output_len: int = 24
    cache_batched_tokens: int = 40  # chunked prefill, cut off block boundaries (16)


QUICK = Settings(
    output_len=8,
    num_prompts=2,
    variants=(("bfloat16", "int4", "strata"),),
    cache_dtypes=("bfloat16",),
    cache_kv_dtypes=("int8",),
    cache_output_len=4,
)


def load_prompts(tokenizer, num_prompts: int | None = None) -> list[tuple[str, list[int]]]:
    """(kind, token ids) of the held-out prompts, chat and plain alternating."""
    data = json.loads(PROMPTS.read_text())
    chats = [
        ("chat", tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}])))
        for c in data["chat"]
    ]
    plain = [("plain", tokenizer.encode(p)) for p in data["plain"]]
    mixed = [p for pair in zip(chats, plain, strict=True) for p in pair]
    return mixed[:num_prompts]


def until_eos(tokens: Sequence[int], eos: set[int], output_len: int) -> list[int]:
    """``tokens`` up to and including the first end-of-generation token, at most output_len."""
    out = []
    for token in list(tokens)[:output_len]:
        out.append(int(token))
        if token in eos:
            break
    return out


def first_divergence(reference: list[int], tokens: list[int]) -> int | None:
    """The first index where ``tokens`` differs from ``reference``; None where equal."""
    for i, (a, b) in enumerate(zip(reference, tokens, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def transformers_greedy(model, prompt: list[int], output_len: int, eos: set[int]) -> list[int]:
    """transformers' greedy tokens: argmax of each step's logits, its own KV cache."""
    tokens: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        while len(tokens) < output_len and (not tokens or tokens[-1] not in eos):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)
    return tokens


def float_margin(model, prompt: list[int], reference: list[int], tokens: list[int]) -> float:
    """At the first token where ``tokens`` leave ``reference``: how far the reference model's
    logit of its own token is above that of the token taken instead (0: a tie). 0.0 where the
    outputs are the same or one only ended early."""
    at = first_divergence(reference, tokens)
    if at is None or at >= min(len(reference), len(tokens)):
        return 0.0
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + reference[:at]])).logits[0, -1].float()
    return float(logits[reference[at]] - logits[tokens[at]])


def load_transformers(path: Path):
    """transformers' float32 load of the GGUF file (its weights dequantized)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def strata_greedy(llm: LLM, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Each prompt alone, greedy, ending at an end-of-generation token."""
    greedy = SamplingParams(max_tokens=output_len, temperature=0)
    return [list(llm.generate(p, greedy).token_ids) for p in prompts]


def variant_name(variant: tuple[str, str, str]) -> str:
    dtype, quantization, kernel = variant
    if dtype == "auto":
        return "auto"
    return f"{dtype}/{quantization}" + (f"-{kernel}" if quantization == "int4" else "")


def measure_divergence(model: str, s: Settings) -> dict[str, object]:
    """First divergence of every engine on every prompt; the reference's tokens."""
    path = packaged_model_path(model)
    reference_model = load_transformers(path)
    engines: dict[str, dict[str, object]] = {}
    tokenizer, prompts, eos, reference = None, [], set(), []
    for variant in s.variants:
        dtype, quantization, kernel = variant
        # The native stack gives eager's bits (docs/design.md): no need to time both.
        stack = "auto" if dtype == "auto" else "native"
        options = {"quantization": quantization, "int4_kernel": kernel, "decoder_stack": stack}
        with LLM(model, dtype=dtype, **options) as llm:
            if tokenizer is None:
                tokenizer = llm.tokenizer
                prompts = load_prompts(tokenizer, s.num_prompts)
                eos = set(tokenizer.eos_token_ids)
                reference = [
                    transformers_greedy(reference_model, p, s.output_len, eos) for _, p in prompts
                ]
            outputs = strata_greedy(llm, [p for _, p in prompts], s.output_len)
            config = llm.engine.config
            print(f"{variant_name(variant)}: {config.dtype}/{config.quantization}", flush=True)
            engines[variant_name(variant)] = {
                "runs": f"{config.dtype}/{config.quantization}/{config.decoder_stack}"
                f"/{config.int4_kernel}",
                **_divergence(reference_model, prompts, reference, outputs, eos, s),
            }
    peer, note = open_peer(str(path), torch.get_num_threads(), 1024)
    if peer is not None:
        outputs = [peer.decode([p], s.output_len).token_ids[0] for _, p in prompts]
        engines["llama.cpp"] = {
            "runs": f"llama-cpp-python {peer.lib.__version__}",
            **_divergence(reference_model, prompts, reference, outputs, eos, s),
        }
    return {
        "prompts": [{"kind": k, "num_tokens": len(p)} for k, p in prompts],
        "reference_lengths": [len(r) for r in reference],
        "engines": engines,
        "peer_note": note,
    }


def _divergence(model, prompts, reference, outputs, eos: set[int], s: Settings) -> dict:
    """Per prompt: the first divergence and the reference's logit margin there."""
    outputs = [until_eos(o, eos, s.output_len) for o in outputs]
    pairs = list(zip(prompts, reference, outputs, strict=True))
    return {
        "first_divergence": [first_divergence(r, o) for _, r, o in pairs],
        "float_margin": [float_margin(model, p, r, o) for (_, p), r, o in pairs],
    }


def measure_caching(model: str, s: Settings) -> list[dict[str, object]]:
    """Per (dtype, kv_cache_dtype): the chat prompts behind SYSTEM with caching on and off."""
    rows = []
    for dtype in s.cache_dtypes:
        for kv in s.cache_kv_dtypes:
            outputs, cached = {}, 0
            for caching in (False, True):
                scheduler = SchedulerConfig(
                    prefix_cache_config=PrefixCacheConfig(enabled=caching),
                    max_num_batched_tokens=s.cache_batched_tokens,
                )
                options = {"dtype": dtype, "kv_cache_dtype": kv, "int4_kernel": "strata"}
                with LLM(
                    model,
                    scheduler_config=scheduler,
                    quantization="int4",
                    decoder_stack="native",
                    **options,
                ) as llm:
                    prompts = _system_chats(llm, s.num_prompts)
                    greedy = SamplingParams(max_tokens=s.cache_output_len, temperature=0)
                    results = [llm.generate(p, greedy) for p in prompts]
                    outputs[caching] = [list(r.token_ids) for r in results]
                    cached = max(cached, *(r.num_cached_tokens for r in results))
            differ = [
                i
                for i, (a, b) in enumerate(zip(outputs[False], outputs[True], strict=True))
                if a != b
            ]
            rows.append(
                {
                    "dtype": dtype,
                    "kv_cache_dtype": kv,
                    "num_prompts": len(outputs[False]),
                    "num_differ": len(differ),
                    "first_divergence": [
                        first_divergence(outputs[False][i], outputs[True][i]) for i in differ
                    ],
                    "max_cached_tokens": cached,
                }
            )
            print(rows[-1], flush=True)
    return rows


def _system_chats(llm: LLM, num_prompts: int | None) -> list[str]:
    questions = json.loads(PROMPTS.read_text())["chat"][:num_prompts]
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in questions
    ]


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = DEFAULT_MODEL
) -> dict[str, object]:
    s = QUICK if quick else Settings()
    divergence = measure_divergence(model, s)
    caching = measure_caching(model, s)
    report = Report(
        scenario=NAME,
        title="Fidelity: greedy outputs against transformers' float load, and caching on vs off",
        command=command,
        quick=quick,
        summary=(__doc__ or "").split("\n\n", 1)[1].strip(),
        results={"settings": _settings(s), "divergence": divergence, "caching": caching},
    )
    _tables(report, divergence, caching, s)
    report.figures["first_divergence.png"] = _plot(divergence, s)
    return report.write(output_dir)


def _settings(s: Settings) -> dict[str, object]:
    return {
        "output_len": s.output_len,
        "num_prompts": s.num_prompts,
        "variants": [variant_name(v) for v in s.variants],
        "cache_output_len": s.cache_output_len,
        "cache_batched_tokens": s.cache_batched_tokens,
    }


def _summary_row(name: str, entry: dict, output_len: int) -> list[object]:
    firsts = entry["first_divergence"]
    positions = sorted(output_len if f is None else f for f in firsts)
    return [
        name,
        entry["runs"],
        f"{sum(f is None for f in firsts)}/{len(firsts)}",
        positions[len(positions) // 2],
        positions[0],
        f"{max(entry['float_margin']):.2f}",
        " ".join("=" if f is None else str(f) for f in firsts),
    ]


def _tables(report: Report, divergence: dict, caching: list[dict], s: Settings) -> None:
    report.add_table(
        f"First divergence from transformers' float32 greedy output ({s.output_len} tokens at "
        "most; '=': the same output)",
        ["engine", "runs", "same output", "median", "min", "largest float margin", "per prompt"],
        [_summary_row(n, e, s.output_len) for n, e in divergence["engines"].items()],
    )
    if divergence["peer_note"]:
        report.sections.append(divergence["peer_note"])
    report.add_table(
        f"Caching on vs off: chat prompts behind a shared system prompt, {s.cache_output_len} "
        f"greedy tokens, max_num_batched_tokens {s.cache_batched_tokens}, int4 weights",
        ["dtype", "kv_cache_dtype", "prompts differing", "first divergence", "cached tokens"],
        [
            [
                r["dtype"],
                r["kv_cache_dtype"],
                f"{r['num_differ']}/{r['num_prompts']}",
                " ".join(map(str, r["first_divergence"])) or "-",
                r["max_cached_tokens"],
            ]
            for r in caching
        ],
    )


def _plot(divergence: dict, s: Settings):
    figure, (axes,) = new_figure()
    for name, entry in divergence["engines"].items():
        firsts = [s.output_len if f is None else f for f in entry["first_divergence"]]
        axes.plot(range(len(firsts)), firsts, marker="o", linestyle="", label=name)
    axes.set_xlabel("prompt")
    axes.set_ylabel(f"first divergent token ({s.output_len}: none)")
    axes.legend(fontsize=6)
    return figure
