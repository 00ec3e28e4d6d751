"""engine-vs-llamacpp: Strata's engine vs llama.cpp on the same GGUF file and threads.

Strata (``cluster.LLM`` in this process, one engine per variant: ``auto``, Strata's default,
which measures on this machine at start-up which dtype, weights and decoder stack to run, and
each ``--dtype`` x ``--quantization`` pair it chooses among, each with every
``--decoder-stack`` asked for: ``auto`` by default) and
llama.cpp (llama-cpp-python's ``Llama``, driven token by token through ``Llama.eval``) load the
same GGUF file and compute with the same number of threads (torch's intra-op threads;
llama.cpp's ``n_threads`` and ``n_threads_batch``). Four measurements, every side taking its
turn within each repetition in an order that rotates, on the same random token ids; medians:

1. *cold prefill*: time to the first token of a prompt that nothing has seen (Strata: a new
   prompt, checked that no token came from the prefix cache, so that the cached prefixes of 2.
   stay; llama.cpp: its KV emptied, as ``reset()`` does, and checked to end at the prompt's
   last position afterwards);
2. *cached-prefix chunk*: time to the first token of a prefix that is already cached plus a
   fresh chunk (Strata: the prefix is in its prefix cache, checked with ``num_cached_tokens``,
   its last partial block as the freed block of the request that held it; llama.cpp: its KV
   holds the prefix, cut back to it before each chunk, checked to end at the prefix before and
   at the chunk after: it computed the chunk alone);
3. *decode*: tokens after the first over the time after the first token, greedy, EOS ignored;
   llama.cpp at batch 1 (one ``eval`` per token), Strata at every batch size (one
   ``LLM.generate`` call of the whole batch; aggregate tokens/s);
4. *perplexity* of ``tests/data/perplexity.txt``, tokenized by Strata's tokenizer, both sides
   fed the same ids in non-overlapping windows whose first token is context only (Strata:
   ``replicas.model.perplexity.perplexity``; llama.cpp: log-softmax of its logits).

Ratios are Strata / llama.cpp. The report names the CPU (model, flags, torch's capability),
what ``auto`` chose and the start-up timings it chose from, and how far its representative
request (``replicas.model.autotune``: 256 prompt tokens, 128 output tokens, priced here at the
cold prefill and batch-1 decode rates measured) is from the fastest variant's. Without
llama-cpp-python, or when it dies evaluating a few tokens in a child process (native code; see
``REINSTALL_PEER_WITHOUT_AMX``), only Strata is measured and the report says why.
"""

import math
import random
import resource
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from matplotlib.figure import Figure

from benchmarks.decode import Timing, run_strata
from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    BLOCK_SIZE,
    build_llm,
    fit_length,
    median,
    model_context_len,
    prompt_vocab,
    random_tokens,
    rotated,
    timed_request,
)
from cluster import LLM, SamplingParams
from replicas.model.autotune import OUTPUT_TOKENS, PROMPT_TOKENS
from replicas.model.perplexity import perplexity
from replicas.model.quant import QUANTIZATIONS
from replicas.model.resolve import resolve_model

NAME = "engine-vs-llamacpp"
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_THREADS = 2
VARIANTS = ("auto", *QUANTIZATIONS)  # Strata's --quantization values
DTYPES = ("auto", "float32", "bfloat16")  # Strata's --dtype values measured by default
GGUF_4_BIT = "int4"  # computes with a Q4_0/Q4_1 GGUF file's 4-bit codes as stored
PEER = "llama-cpp-python==0.3.36"
INSTALL_PEER = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -e ".[peers]"'
# GGML_NATIVE=ON builds llama.cpp's AMX kernels on a CPU that has AMX; in 0.3.36 they can die
# of SIGILL at their first tile instruction (ggml-org/llama.cpp#26954). The same CPU features
# less AMX:
REINSTALL_PEER_WITHOUT_AMX = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
    "-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
    f'-DGGML_AVX512_BF16=ON" pip install --force-reinstall --no-deps --no-cache-dir {PEER}'
)
TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity.txt"
# Targets, Strata against llama.cpp unless said otherwise.
DECODE_TARGET = 1.0  # batch-1 decode tokens/s >= this x llama.cpp's
CHUNK_TARGET = 1.0  # cached-prefix chunk time <= this x llama.cpp's, at every prefix length
PREFILL_TARGET = 2.0  # cold prefill tokens/s >= this x llama.cpp's
AUTO_TARGET = 1.05  # auto's representative request time <= this x the fastest variant's
SPEC_COPY_TARGET = 1.5  # speculative decode tokens/s >= this x plain where outputs copy prompts
SPEEDUP_STATISTIC = (
    "the median over rounds of each round's speculative/plain decode rate (both run back to back "
    "in a round, in alternating order)"
)
SPEC_FREE_TARGET = 0.95  # and >= this x plain where they do not
# Speculative rows: chat prompts whose answer copies spans of the prompt, and one whose does not.
# The passage is a part of the shipped perplexity text (held out from nothing: it is only read).
SPEC_WORKLOADS = {
    "quote": "Repeat the following text exactly, word for word:\n\n{passage}",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
BATCH_TARGET = 4.0  # Strata's aggregate decode at its largest batch >= this x its batch 1
PERPLEXITY_TARGET = 1.01  # GGUF_4_BIT variants: perplexity <= this x llama.cpp's


@dataclass(frozen=True, slots=True)
class Settings:
    prompt_len: int = 1500  # cold prefill
    context_lens: tuple[int, ...] = (64, 1500, 4000)  # cached prefixes
    chunk_len: int = 12  # fresh tokens after a cached prefix
    decode_prompt_len: int = 32
    output_len: int = 128
    batch_sizes: tuple[int, ...] = (1, 8, 32)  # Strata; llama.cpp decodes at batch 1
    variants: tuple[tuple[str, str, str], ...] = tuple(
        (d, q, "auto") for d in DTYPES for q in VARIANTS if (d == "auto") == (q == "auto")
    )  # (dtype, quantization, decoder_stack): auto with auto, then every explicit pair
    perplexity_window: int = 512
    perplexity_max_windows: int | None = None  # None: every whole window of the text
    repeats: int = 5
    warmup_repeats: int = 1  # whole rounds run first and not recorded
    seed: int = 0
    speculative_ngram: int = 4  # draft tokens of the speculative rows (0: no such rows)
    speculative_output_len: int = 128
    # Rounds of the speculative rows: a 128-token run is about a second, and its rate on a
    # shared VM varies by 10% from run to run, more than the 5% the free workload's bound leaves.
    speculative_repeats: int = 9
    passage_chars: int = 600


QUICK = Settings(
    prompt_len=128,
    context_lens=(64, 256),
    output_len=8,
    variants=(("auto", "auto", "auto"),),
    perplexity_window=64,
    perplexity_max_windows=2,
    repeats=1,
    warmup_repeats=0,
    speculative_output_len=16,
    speculative_repeats=1,
    passage_chars=200,
)


REAL_SIZE = Settings(
    prompt_len=512,
    context_lens=(1000, 4000),
    batch_sizes=(1, 32),
    variants=(("auto", "auto", "auto"),),
    perplexity_max_windows=8,
    repeats=3,
    speculative_ngram=0,
)
"""``--real-size``: the rows a model of a real size is compared on, in minutes rather than
hours at 1.7B."""


class Side(Protocol):
    """One engine under test. Every method runs to completion before it returns."""

    name: str
    max_batch_size: int

    def prefill_s(self, prompt: list[int]) -> float:
        """Seconds to the first token of ``prompt``, none of it cached (checked)."""

    def hold_prefix(self, prefix: list[int]) -> None:
        """Keep ``prefix``'s KV for ``chunk`` (untimed)."""

    def chunk(self, prefix: list[int], chunk: list[int]) -> tuple[float, int]:
        """Seconds to the first token of ``prefix + chunk`` with ``prefix`` held, and how many
        prompt tokens were computed."""

    def decode(self, prompts: list[list[int]], output_len: int) -> Timing: ...

    def perplexity(self, token_ids: list[int], window: int) -> float:
        """Perplexity of ``token_ids`` (whole windows) in non-overlapping windows."""


class StrataSide:
    """Strata's engine in this process with one (dtype, quantization, decoder_stack) variant."""

    def __init__(self, llm: LLM, variant: tuple[str, str, str], max_batch_size: int) -> None:
        self.llm = llm
        loaded = llm.engine.loaded
        self.computes_with = loaded.quantization  # what auto chose, or the variant
        kernel = "-strata" if loaded.int4_kernel == "strata" else ""
        self.runs = (
            f"{llm.engine.config.dtype}/{loaded.quantization}{kernel}/{loaded.decoder_stack}"
        )
        self.auto = loaded.auto  # the start-up measurement, where auto asked for one
        name = "/".join(dict.fromkeys(variant))
        self.name = f"Strata {name}" if name == self.runs else f"Strata {name} ({self.runs})"
        self.max_batch_size = max_batch_size

    def prefill_s(self, prompt: list[int]) -> float:
        output = timed_request(self.llm, prompt)
        if output.num_cached_tokens:
            raise RuntimeError(f"{self.name}: {output.num_cached_tokens} cold tokens cached")
        return output.ttft_s

    def hold_prefix(self, prefix: list[int]) -> None:
        timed_request(self.llm, prefix)

    def chunk(self, prefix: list[int], chunk: list[int]) -> tuple[float, int]:
        output = timed_request(self.llm, prefix + chunk)
        whole_blocks = len(prefix) // BLOCK_SIZE * BLOCK_SIZE
        if output.num_cached_tokens < whole_blocks:
            raise RuntimeError(
                f"{self.name}: {output.num_cached_tokens} tokens of a {len(prefix)}-token "
                f"prefix cached, expected {whole_blocks} (its whole blocks)"
            )
        return output.ttft_s, len(prefix) + len(chunk) - output.num_cached_tokens

    def decode(self, prompts: list[list[int]], output_len: int) -> Timing:
        return run_strata(self.llm, prompts, output_len)

    def perplexity(self, token_ids: list[int], window: int) -> float:
        return perplexity(self.llm.engine.loaded.model, token_ids, window)


class LlamaCppSide:
    """llama.cpp through llama-cpp-python's low-level ``Llama.eval``, which evaluates exactly
    the tokens it is given after the first ``n_tokens`` of its KV (it drops the KV after
    ``n_tokens`` first; only ``generate`` and ``create_completion`` reuse a matching prompt
    prefix). One context for cold prompts and decoding, one per held prefix, one with every
    position's logits for perplexity."""

    name = "llama.cpp"
    max_batch_size = 1

    def __init__(
        self, llama_cpp: object, path: str, threads: int, n_ctx: int, extra_buffer_types: bool
    ) -> None:
        self.lib = llama_cpp
        if not extra_buffer_types:
            _without_extra_buffer_types(llama_cpp)
        self.options = {"n_threads": threads, "n_threads_batch": threads, "verbose": False}
        self.path = path
        self.main = self._open(n_ctx)
        self.held: dict[int, tuple[object, list[int]]] = {}  # prefix length -> (Llama, prefix)
        self.main.eval(list(range(1, 2 * BLOCK_SIZE)))  # warm-up

    def system_info(self) -> str:
        """What llama.cpp was built for and uses on this CPU (its instruction sets)."""
        return self.lib.llama_print_system_info().decode().strip()

    def _open(self, n_ctx: int, **options: object) -> object:
        n_ctx = -(-n_ctx // 256) * 256  # llama.cpp pads contexts to 256
        return self.lib.Llama(model_path=self.path, n_ctx=n_ctx, **self.options, **options)

    def _timed_eval(self, llm: object, kept: int, tokens: list[int]) -> tuple[float, int]:
        """Cut ``llm``'s KV back to its first ``kept`` positions; then the seconds to evaluate
        ``tokens`` after them and pick the next token greedily, and that token. Checked on the
        KV itself: it ends at position ``kept - 1`` before and ``kept + len(tokens) - 1`` after,
        so llama.cpp computed ``tokens`` from scratch after the ``kept`` positions it reused."""
        memory = self.lib.llama_get_memory(llm.ctx)
        self.lib.llama_memory_seq_rm(memory, -1, kept, -1)
        llm.n_tokens = kept  # where Llama.eval writes next (what reset() sets to 0)
        before = self.lib.llama_memory_seq_pos_max(memory, 0)
        start = time.perf_counter()
        llm.eval(tokens)
        token = self._greedy(llm)
        elapsed = time.perf_counter() - start
        after = self.lib.llama_memory_seq_pos_max(memory, 0)
        if (before, after, llm.n_tokens) != (kept - 1, kept + len(tokens) - 1, kept + len(tokens)):
            raise RuntimeError(
                f"llama.cpp's KV ended at position {before} before evaluating {len(tokens)} "
                f"tokens and at {after} after (expected {kept - 1} and "
                f"{kept + len(tokens) - 1}); it holds {llm.n_tokens} tokens"
            )
        return elapsed, token

    def _greedy(self, llm: object) -> int:
        logits = self.lib.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),)).argmax())

    def prefill_s(self, prompt: list[int]) -> float:
        return self._timed_eval(self.main, 0, prompt)[0]

    def hold_prefix(self, prefix: list[int]) -> None:
        llm, held = self.held.get(len(prefix), (None, None))
        if held == prefix:
            return
        llm = llm or self._open(len(prefix) + 256)  # room for a chunk after the prefix
        llm.reset()
        llm.eval(prefix)
        self.held[len(prefix)] = (llm, list(prefix))

    def chunk(self, prefix: list[int], chunk: list[int]) -> tuple[float, int]:
        llm, held = self.held[len(prefix)]
        if held != prefix:
            raise RuntimeError(f"llama.cpp holds another {len(prefix)}-token prefix")
        return self._timed_eval(llm, len(prefix), chunk)[0], len(chunk)

    def decode(self, prompts: list[list[int]], output_len: int) -> Timing:
        (prompt,) = prompts
        start = time.monotonic()
        tokens = [self._timed_eval(self.main, 0, prompt)[1]]
        first = time.monotonic()
        while len(tokens) < output_len:
            self.main.eval(tokens[-1:])
            tokens.append(self._greedy(self.main))
        end = time.monotonic()
        return Timing(end - start, end - first, [tokens])

    def perplexity(self, token_ids: list[int], window: int) -> float:
        llm = self._open(window, n_batch=window, n_ubatch=window, logits_all=True)
        try:
            nll, count = 0.0, 0
            for start in range(0, len(token_ids) - window + 1, window):
                tokens = token_ids[start : start + window]
                llm.reset()
                llm.eval(tokens)
                nll += window_nll(llm.scores[:window], tokens)
                count += window - 1
        finally:
            llm.close()
        return math.exp(nll / count)


def window_nll(logits: np.ndarray, tokens: list[int]) -> float:
    """Summed negative log-likelihood of ``tokens[1:]``; row i of ``logits`` predicts token
    i + 1, so the first token is context only."""
    x = logits[:-1].astype(np.float64)
    top = x.max(axis=1)
    log_sum = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    return float((log_sum - x[np.arange(len(tokens) - 1), tokens[1:]]).sum())


def open_peer(path: str, threads: int, n_ctx: int) -> tuple[LlamaCppSide | None, str | None]:
    """llama.cpp's side, or None and why not (llama-cpp-python is an optional extra)."""
    try:
        import llama_cpp
    except ImportError as error:
        return None, (
            f"llama.cpp was not measured: llama-cpp-python is not installed ({error}). "
            f"Install it ({PEER}, the `peers` extra) with `{INSTALL_PEER}`; it compiles "
            "llama.cpp, several minutes."
        )
    failure = _peer_failure(path, threads, extra_buffer_types=True)
    if failure is None:
        return LlamaCppSide(llama_cpp, path, threads, n_ctx, extra_buffer_types=True), None
    if _peer_failure(path, threads, extra_buffer_types=False) is None:
        note = (
            f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) {failure}, and ran with its "
            "extra buffer types (AMX and CPU repacking) off. A SIGILL there is most likely its "
            "AMX kernels under a Linux that enables AMX state per thread "
            "(ggml-org/llama.cpp#26954); a build without AMX keeps the repacking: "
            f"`{REINSTALL_PEER_WITHOUT_AMX}`."
        )
        return LlamaCppSide(llama_cpp, path, threads, n_ctx, extra_buffer_types=False), note
    return None, (
        f"llama.cpp was not measured: llama-cpp-python {llama_cpp.__version__} {failure}, with "
        f"and without its extra buffer types. Rebuild it: `{REINSTALL_PEER_WITHOUT_AMX}`."
    )


def _without_extra_buffer_types(llama_cpp: object) -> None:
    """Every model llama-cpp-python opens from now on, in this process, skips llama.cpp's extra
    buffer types (``use_extra_bufts``), which 0.3.36's ``Llama`` does not expose."""
    default = llama_cpp.llama_model_default_params
    if getattr(default, "without_extra_buffer_types", False):
        return

    def params() -> object:
        p = default()
        p.use_extra_bufts = False
        return p

    params.without_extra_buffer_types = True
    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params


_PROBE = """import sys, llama_cpp
if sys.argv[3] == "0":
    default = llama_cpp.llama_model_default_params
    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama.llama_cpp.llama_model_default_params = params
llm = llama_cpp.Llama(
    model_path=sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
    verbose=False,
)
llm.eval(list(range(1, 65)))
"""


def _peer_failure(path: str, threads: int, extra_buffer_types: bool) -> str | None:
    """How llama.cpp failed to evaluate 64 tokens in a child process, or None if it did. It is
    native code that can die of a signal, which would end this process and every figure."""
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, path, str(threads), str(int(extra_buffer_types))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if probe.returncode == 0:
        return None
    code = probe.returncode
    how = f"of {signal.Signals(-code).name}" if code < 0 else f"with exit status {code}"
    stderr = probe.stderr.strip()[-300:]
    return f"died {how} evaluating 64 tokens in a child process" + f" ({stderr})" * bool(stderr)


@dataclass(slots=True)
class Samples:
    """What ``measure`` recorded, by side name (and prefix length or batch size)."""

    prefill_s: dict[str, list[float]]
    chunk_s: dict[tuple[str, int], list[float]]
    chunk_computed_tokens: dict[tuple[str, int], int]
    decode: dict[tuple[str, int], list[Timing]]


def measure(sides: list[Side], s: Settings, vocab: int) -> Samples:
    """Every measurement, side by side: each repetition runs every side once per measurement,
    in an order that rotates."""
    rng = random.Random(s.seed)
    prefixes = [random_tokens(rng, c, vocab) for c in s.context_lens]
    for side in sides:
        for prefix in prefixes:
            side.hold_prefix(prefix)
    samples = Samples({x.name: [] for x in sides}, defaultdict(list), {}, defaultdict(list))
    for rep in range(-s.warmup_repeats, s.repeats):
        prompt = random_tokens(rng, s.prompt_len, vocab)
        for side in rotated(sides, rep):
            seconds = side.prefill_s(prompt)
            if rep >= 0:
                samples.prefill_s[side.name].append(seconds)
        for i, prefix in enumerate(prefixes):
            chunk = random_tokens(rng, s.chunk_len, vocab)
            for side in rotated(sides, rep + i):
                key = (side.name, len(prefix))
                seconds, samples.chunk_computed_tokens[key] = side.chunk(prefix, chunk)
                if rep >= 0:
                    samples.chunk_s[key].append(seconds)
        for b, batch in enumerate(s.batch_sizes):
            prompts = [random_tokens(rng, s.decode_prompt_len, vocab) for _ in range(batch)]
            for side in rotated([x for x in sides if x.max_batch_size >= batch], rep + b):
                with torch.inference_mode():
                    timing = side.decode(prompts, s.output_len)
                if rep >= 0:
                    samples.decode[(side.name, batch)].append(timing)
        print(f"{'warm-up' if rep < 0 else f'repetition {rep + 1}/{s.repeats}'} done", flush=True)
    return samples


PRODUCTS = ("_weight_int4pack_mm", "_weight_int8pack_mm", "strata_native::int4_mm", "aten::mm")
PRODUCTS += ("aten::addmm",)
# "scaled_dot_product" also matches the CPU flash kernel's own event, where SDPA's time is.
ATTENTION = (
    "scaled_dot_product",
    "strata_native::decode_attention",
    "index_select",
    "index_copy",
    "aten::bmm",
)


def profile_decode(llm: LLM, s: Settings, vocab: int) -> dict[str, float]:
    """Where a batch-1 decode step's time goes (``torch.profiler``, after the measurement): the
    ops' own CPU time by kind (linear products, attention, every other op) and what is in no
    op (Python and dispatch), in milliseconds per step and as shares of the profiled step. The
    profiler's own cost per op inflates the last share somewhat; ratios, not absolutes."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(s.seed + 1)
    warmup, prompt = (random_tokens(rng, s.decode_prompt_len, vocab) for _ in range(2))
    steps = max(s.output_len, 2)
    with torch.inference_mode():
        run_strata(llm, [warmup], 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run_strata(llm, [prompt], steps)
            wall_s = time.perf_counter() - start
    kinds = {"products": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        if any(name in event.key for name in PRODUCTS):
            kinds["products"] += seconds
        elif any(name in event.key for name in ATTENTION):
            kinds["attention"] += seconds
        elif event.key.startswith("aten::"):
            kinds["other ops"] += seconds
    kinds["python and dispatch"] = max(wall_s - sum(kinds.values()), 0.0)
    result = {f"{kind} ms/step": 1e3 * t / steps for kind, t in kinds.items()}
    return result | {f"{kind} share": t / wall_s for kind, t in kinds.items()}


def measure_speculative(
    base: StrataSide, s: Settings, num_blocks: int, max_model_len: int, model: str
) -> list[dict]:
    """Decode tokens/s of ``base`` (the first variant, Strata's default) against the same
    configuration with ``speculative_ngram`` drafts, on each of ``SPEC_WORKLOADS`` (greedy,
    EOS ignored, the prefix cache emptied before each run), side by side in every repetition;
    and whether the two gave the same tokens."""
    if not s.speculative_ngram:
        return []
    spec = build_llm(
        num_npu_blocks=num_blocks,
        max_model_len=max_model_len,
        model=model,
        dtype=base.llm.engine.config.dtype,
        quantization=base.llm.engine.config.quantization,
        decoder_stack=base.llm.engine.config.decoder_stack,
        int4_kernel=base.llm.engine.config.int4_kernel,  # the same products: the same tokens
        speculative_ngram=s.speculative_ngram,
    )
    passage = TEXT.read_text()[: s.passage_chars]
    params = SamplingParams(max_tokens=s.speculative_output_len, temperature=0, ignore_eos=True)
    rows = []
    for workload, content in SPEC_WORKLOADS.items():
        prompt = base.llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": content.format(passage=passage)}]
        )
        rates: dict[str, list[float]] = {"plain": [], "speculative": []}
        tokens: dict[str, list[int]] = {}
        drafts = [spec.engine.stats().spec_decode]
        for rep in range(-s.warmup_repeats, s.speculative_repeats):
            for name, llm in rotated([("plain", base.llm), ("speculative", spec)], rep):
                llm.reset_prefix_cache("all")
                output = llm.generate(prompt, params)
                end = time.monotonic()
                tokens[name] = list(output.token_ids)
                if rep >= 0:
                    rate = (len(output.token_ids) - 1) / (end - output.first_token_time)
                    rates[name].append(rate)
        drafts.append(spec.engine.stats().spec_decode)
        plain, fast = median(rates["plain"]), median(rates["speculative"])
        # Each round runs both back to back, so a round's ratio is free of the VM's drift from
        # round to round, which the ratio of the two medians is not (SPEEDUP_STATISTIC).
        ratios = [f / p for f, p in zip(rates["speculative"], rates["plain"], strict=True)]
        rows.append(
            {
                "workload": workload,
                "prompt_tokens": len(base.llm.tokenizer.encode(prompt)),
                "plain_tokens_per_s": plain,
                "speculative_tokens_per_s": fast,
                "speedup": median(ratios),
                "ratio_of_medians": fast / plain,
                "draft_tokens": drafts[1].num_draft_tokens - drafts[0].num_draft_tokens,
                "accepted_tokens": drafts[1].num_accepted_tokens - drafts[0].num_accepted_tokens,
                "same_tokens": tokens["plain"] == tokens["speculative"],
                "samples": rates,
            }
        )
    spec.shutdown()
    return rows


def measure_compiled(
    base: StrataSide, s: Settings, num_blocks: int, max_model_len: int, model: str
) -> list[dict]:
    """The default variant (``base``, eager) against the same configuration with
    ``torch_compile``, side by side in every repetition: how long the compiled engine took to
    build and serve its first request (compiling), its cold prefill and batch-1 decode against
    eager's, and whether both gave the same tokens."""
    start = time.perf_counter()
    fast = build_llm(
        num_npu_blocks=num_blocks,
        max_model_len=max_model_len,
        model=model,
        dtype=base.llm.engine.config.dtype,
        quantization=base.llm.engine.config.quantization,
        torch_compile=True,
    )
    run_strata(fast, [[1] * s.decode_prompt_len], 2)  # a decode step of one token compiles too
    compile_s = time.perf_counter() - start
    rng = random.Random(s.seed + 2)
    vocab = prompt_vocab(base.llm)
    sides = [("eager", base.llm), ("compiled", fast)]
    prefill: dict[str, list[float]] = {name: [] for name, _ in sides}
    decode: dict[str, list[float]] = {name: [] for name, _ in sides}
    same = True
    for rep in range(-s.warmup_repeats, s.repeats):
        prompt = random_tokens(rng, s.prompt_len, vocab)
        short = random_tokens(rng, s.decode_prompt_len, vocab)
        tokens = {}
        for name, llm in rotated(sides, rep):
            seconds = timed_request(llm, prompt).ttft_s
            with torch.inference_mode():
                timing = run_strata(llm, [short], s.output_len)
            tokens[name] = timing.token_ids
            if rep >= 0:
                prefill[name].append(len(prompt) / seconds)
                decode[name].append((s.output_len - 1) / timing.decode_s)
        same = same and tokens["eager"] == tokens["compiled"]
    failed = fast.engine.loaded.model.compiled.failed
    fast.shutdown()
    return [
        {
            "variant": name,
            "cold_prefill_tokens_per_s": median(prefill[name]),
            "decode_tokens_per_s": median(decode[name]),
            "compile_s": compile_s if name == "compiled" else None,
            "same_tokens": same,
            "failed": failed if name == "compiled" else None,
            "samples": {"prefill": prefill[name], "decode": decode[name]},
        }
        for name, _ in sides
    ]


def summary(name: str, samples: Samples, s: Settings, text_perplexity: float) -> dict:
    """One side's medians (``results.json`` holds the samples too)."""
    prefill = samples.prefill_s[name]
    decode = {b: samples.decode[(name, b)] for b in s.batch_sizes if (name, b) in samples.decode}
    return {
        "name": name,
        "cold_prefill": {
            "median_s": median(prefill),
            "tokens_per_s": s.prompt_len / median(prefill),
            "samples_s": prefill,
        },
        "chunks": [
            {
                "context_len": c,
                "median_s": median(samples.chunk_s[(name, c)]),
                "computed_tokens": samples.chunk_computed_tokens[(name, c)],
                "samples_s": samples.chunk_s[(name, c)],
            }
            for c in s.context_lens
        ],
        "decode": [_rates(timings, b, s.output_len) for b, timings in decode.items()],
        "perplexity": text_perplexity,
    }


def run(
    output_dir: Path,
    *,
    quick: bool,
    command: str,
    model: str = DEFAULT_MODEL,
    dtypes: list[str] | None = None,
    quantizations: list[str] | None = None,
    decoder_stacks: list[str] | None = None,
    threads: int = DEFAULT_THREADS,
    torch_compile: bool = False,
    real_size: bool = False,
) -> dict[str, object]:
    settings = QUICK if quick else REAL_SIZE if real_size else Settings()
    if dtypes or quantizations or decoder_stacks:
        chosen = [
            (d, q, st)
            for d in dtypes or DTYPES
            for q in quantizations or VARIANTS
            for st in decoder_stacks or ("auto",)
        ]
        variants = tuple(v for v in chosen if (v[0] == "auto") == (v[1] == "auto"))
        if not variants:
            raise ValueError("--dtype auto goes with --quantization auto, and only with it")
        settings = replace(settings, variants=variants)
    path = resolve_model(model)
    if not path.endswith(".gguf"):
        raise ValueError(f"engine-vs-llamacpp needs a GGUF file for llama.cpp; '{model}' is not")
    limit = model_context_len(model)
    s = replace(
        settings,
        prompt_len=fit_length(settings.prompt_len, limit),
        context_lens=tuple(
            fit_length(c, limit - settings.chunk_len) for c in settings.context_lens
        ),
    )
    torch.set_num_threads(threads)
    # The NPU tier holds everything one repetition touches, so that the least recently used
    # blocks a new request evicts are the last repetition's, never a prefix touched since.
    decode_len = s.decode_prompt_len + s.output_len
    num_blocks = sum(_blocks(c + s.chunk_len) for c in s.context_lens) + _blocks(s.prompt_len)
    num_blocks += sum(s.batch_sizes) * _blocks(decode_len) + 2 * BLOCK_SIZE
    max_model_len = min(max(s.prompt_len, *s.context_lens, decode_len) + 2 * BLOCK_SIZE, limit)
    strata, startup_s = _strata_sides(s, model, num_blocks, max_model_len)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # all variants
    peer, peer_note = open_peer(path, threads, max(s.prompt_len, decode_len) + BLOCK_SIZE)
    if peer_note:
        print(peer_note)
    sides: list[Side] = [*strata, *([peer] if peer else [])]

    samples = measure(sides, s, prompt_vocab(strata[0].llm))
    for side in strata:
        side.llm.check_integrity()
    profiles = {x.name: profile_decode(x.llm, s, prompt_vocab(x.llm)) for x in strata}
    speculative = measure_speculative(strata[0], s, num_blocks, max_model_len, model)
    compiled = (
        measure_compiled(strata[0], s, num_blocks, max_model_len, model) if torch_compile else []
    )
    text_ids = strata[0].llm.tokenizer.encode(TEXT.read_text())
    num_windows = len(text_ids) // s.perplexity_window
    if s.perplexity_max_windows is not None:
        num_windows = min(num_windows, s.perplexity_max_windows)
    text_ids = text_ids[: num_windows * s.perplexity_window]
    with torch.inference_mode():
        perplexities = {x.name: x.perplexity(text_ids, s.perplexity_window) for x in sides}

    llama = summary(peer.name, samples, s, perplexities[peer.name]) if peer else None
    runs = []
    for side, (d, q, st), up in zip(strata, s.variants, startup_s):
        entry = {"dtype": d, "quantization": q, "decoder_stack": st, "runs": side.runs}
        entry["startup_s"] = up
        entry |= {"computes_with": side.computes_with, "auto": _auto(side)}
        entry |= summary(side.name, samples, s, perplexities[side.name])
        entry["decode_profile"] = profiles[side.name]
        entry["request_s"] = (
            PROMPT_TOKENS / entry["cold_prefill"]["tokens_per_s"]
            + OUTPUT_TOKENS / entry["decode"][0]["decode_tokens_per_s"]
        )
        rates = entry["decode"]
        entry["largest_batch_over_batch_1"] = (
            rates[-1]["decode_tokens_per_s"] / rates[0]["decode_tokens_per_s"]
        )
        if llama:
            entry["over_llama_cpp"] = _ratios(entry, llama)
        runs.append(entry)
    targets = _targets(s, runs) + _speculative_targets(speculative)

    report = Report(
        NAME,
        f"Strata vs llama.cpp on the same GGUF file, model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    _tables(report, s, runs, llama, threads)
    _auto_table(report, runs)
    _profile_table(report, runs)
    _speculative_table(report, s, speculative)
    _compiled_table(report, s, compiled)
    report.add_table(
        "Targets",
        ["engine", "measure", "value", "target", "verdict"],
        [[t["engine"], t["measure"], t["value"], t["target"], t["passed"]] for t in targets],
    )
    report.sections.append(_notes(s, peer_note, peer))
    report.figures["engine_vs_llamacpp.png"] = _plot(s, runs, llama)
    report.results = {
        "model": model,
        "model_path": path,
        "settings": asdict(s),
        "threads": threads,
        "peak_rss_mib_after_loading": peak_rss_mib,
        "perplexity_tokens": len(text_ids),
        "llama_cpp_version": peer.lib.__version__ if peer else None,
        "llama_cpp_options": peer.options if peer else None,
        "llama_cpp_system_info": peer.system_info() if peer else None,
        "peer_note": peer_note,
        "strata": runs,
        "llama_cpp": llama,
        "targets": targets,
        "speculative": speculative,
        "compiled": compiled,
    }
    return report.write(output_dir)


def _strata_sides(
    s: Settings, model: str, num_blocks: int, max_model_len: int
) -> tuple[list[StrataSide], list[float]]:
    """One engine per variant, and each one's start-up time (``auto``'s measurement or its
    cached choice, and the build)."""
    sides, startup_s = [], []
    for d, q, st in s.variants:
        start = time.perf_counter()
        llm = build_llm(
            num_npu_blocks=num_blocks,
            max_model_len=max_model_len,
            model=model,
            dtype=d,
            quantization=q,
            decoder_stack=st,
        )
        startup_s.append(time.perf_counter() - start)
        sides.append(StrataSide(llm, (d, q, st), max(s.batch_sizes)))
    return sides, startup_s


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def _rates(timings: list[Timing], batch: int, output_len: int) -> dict[str, object]:
    decode = [batch * (output_len - 1) / t.decode_s for t in timings]
    return {
        "batch_size": batch,
        "decode_tokens_per_s": median(decode),
        "decode_tokens_per_s_samples": decode,
        "total_s_samples": [t.total_s for t in timings],
    }


def _ratios(entry: dict, llama: dict) -> dict[str, object]:
    """Strata / llama.cpp: of rates (higher: Strata better), times and perplexity (lower)."""
    return {
        "cold_prefill_tokens_per_s": entry["cold_prefill"]["tokens_per_s"]
        / llama["cold_prefill"]["tokens_per_s"],
        "chunk_s": [
            a["median_s"] / b["median_s"] for a, b in zip(entry["chunks"], llama["chunks"])
        ],
        "decode_batch_1_tokens_per_s": entry["decode"][0]["decode_tokens_per_s"]
        / llama["decode"][0]["decode_tokens_per_s"],
        "perplexity": entry["perplexity"] / llama["perplexity"],
    }


def _targets(s: Settings, runs: list[dict]) -> list[dict[str, object]]:
    """Each target of each Strata variant that was measured: value, bound and verdict."""
    targets = []

    def check(engine: str, measure: str, value: float, at_least: bool, bound: float) -> None:
        passed = value >= bound if at_least else value <= bound
        target = f"{'>=' if at_least else '<='} {bound:g}"
        targets.append(
            {"engine": engine, "measure": measure, "value": value, "target": target}
            | {"passed": passed}
        )

    fastest = min(r["request_s"] for r in runs)
    for r in runs:
        engine = r["name"]
        if r["dtype"] == r["decoder_stack"] == "auto" and len(runs) > 1:
            value = r["request_s"] / fastest
            check(engine, "request time / the fastest variant's", value, False, AUTO_TARGET)
        growth = r["largest_batch_over_batch_1"]
        check(engine, f"decode batch {s.batch_sizes[-1]} / batch 1", growth, True, BATCH_TARGET)
        ratios = r.get("over_llama_cpp")
        if ratios is None:
            continue
        decode = ratios["decode_batch_1_tokens_per_s"]
        check(engine, "decode batch 1 tok/s / llama.cpp's", decode, True, DECODE_TARGET)
        for c, value in zip(s.context_lens, ratios["chunk_s"]):
            check(engine, f"chunk after {c} cached, time / llama.cpp's", value, False, CHUNK_TARGET)
        prefill = ratios["cold_prefill_tokens_per_s"]
        check(engine, "cold prefill tok/s / llama.cpp's", prefill, True, PREFILL_TARGET)
        if r["computes_with"] == GGUF_4_BIT:
            value = ratios["perplexity"]
            check(engine, "perplexity / llama.cpp's", value, False, PERPLEXITY_TARGET)
    return targets


def _tables(report: Report, s: Settings, runs: list[dict], llama: dict | None, threads: int):
    sides = [(e["name"], e) for e in [*runs, *([llama] if llama else [])]]

    def ratio(entry: dict, key: str, index: int | None = None) -> object:
        if "over_llama_cpp" not in entry:
            return "-"
        value = entry["over_llama_cpp"][key]
        return value if index is None else value[index]

    report.add_table(
        f"Cold prefill of {s.prompt_len} tokens (median of {s.repeats}, {threads} threads)",
        ["engine", "time to first token (ms)", "tokens/s", "/ llama.cpp"],
        [
            [name, e["cold_prefill"]["median_s"] * 1e3, e["cold_prefill"]["tokens_per_s"]]
            + [ratio(e, "cold_prefill_tokens_per_s")]
            for name, e in sides
        ],
    )
    report.add_table(
        f"A cached prefix plus {s.chunk_len} new tokens: time to first token (ms, median)",
        ["engine", *(f"{c} cached" for c in s.context_lens)]
        + [f"/ llama.cpp at {c}" for c in s.context_lens]
        + ["tokens computed"],
        [
            [name, *(c["median_s"] * 1e3 for c in e["chunks"])]
            + [ratio(e, "chunk_s", i) for i in range(len(s.context_lens))]
            + [" / ".join(str(c["computed_tokens"]) for c in e["chunks"])]
            for name, e in sides
        ],
    )
    batches = s.batch_sizes
    report.add_table(
        f"Decode tokens/s ({s.decode_prompt_len}-token prompts, {s.output_len} output tokens, "
        "aggregate over the batch; llama.cpp at batch 1)",
        ["engine", *(f"batch {b}" for b in batches), "batch 1 / llama.cpp"]
        + [f"batch {batches[-1]} / batch 1"],
        [
            [name]
            + [r["decode_tokens_per_s"] for r in e["decode"]]
            + ["-"] * (len(batches) - len(e["decode"]))
            + [ratio(e, "decode_batch_1_tokens_per_s"), e.get("largest_batch_over_batch_1", "-")]
            for name, e in sides
        ],
    )
    report.add_table(
        f"Perplexity of {TEXT.name} ({s.perplexity_window}-token windows)",
        ["engine", "perplexity", "/ llama.cpp"],
        [[name, e["perplexity"], ratio(e, "perplexity")] for name, e in sides],
    )


def _auto(side: StrataSide) -> dict | None:
    if side.auto is None:
        return None
    return {
        "chose": side.runs,
        "source": side.auto.source,
        "timings": [
            {
                "candidate": str(t.candidate),
                "prefill_ms_per_token": 1e3 * t.prefill_s_per_token,
                "decode_ms": 1e3 * t.decode_s,
                "request_s": t.request_s,
            }
            for t in side.auto.timings
        ],
    }


def _auto_table(report: Report, runs: list[dict]) -> None:
    for r in runs:
        if r["auto"] is None:
            continue
        report.add_table(
            f"What auto chose: {r['auto']['chose']} ({r['auto']['source']}), from its start-up "
            f"timings ({PROMPT_TOKENS}-token prompt, {OUTPUT_TOKENS} output tokens a request)",
            ["candidate", "prefill ms/token", "decode ms/step", "request s"],
            [
                [t["candidate"], t["prefill_ms_per_token"], t["decode_ms"], t["request_s"]]
                for t in r["auto"]["timings"]
            ],
        )
    report.add_table(
        f"Every variant's representative request ({PROMPT_TOKENS} prompt tokens at its cold "
        f"prefill rate, {OUTPUT_TOKENS} tokens at its batch-1 decode rate)",
        ["engine", "runs", "request s", "start-up s"],
        [[r["name"], r["runs"], r["request_s"], r["startup_s"]] for r in runs],
    )


def _speculative_targets(rows: list[dict]) -> list[dict[str, object]]:
    bounds = {"quote": SPEC_COPY_TARGET, "free": SPEC_FREE_TARGET}
    return [
        {
            "engine": f"Strata speculative, {r['workload']}",
            "measure": "decode tok/s / without drafts (same tokens)",
            "value": r["speedup"],
            "target": f">= {bounds[r['workload']]:g}",
            "passed": r["speedup"] >= bounds[r["workload"]] and r["same_tokens"],
        }
        for r in rows
    ]


def _speculative_table(report: Report, s: Settings, rows: list[dict]) -> None:
    if not rows:
        return
    report.add_table(
        f"Speculative decoding (n-gram drafts, --speculative-ngram {s.speculative_ngram}) on "
        f"the default variant: chat prompts, {s.speculative_output_len} greedy tokens, "
        f"median decode tokens/s of {s.speculative_repeats} rounds; speedup: {SPEEDUP_STATISTIC}",
        ["workload", "prompt tokens", "plain tok/s", "speculative tok/s", "speedup"]
        + ["ratio of medians", "drafts accepted", "same tokens"],
        [
            [r["workload"], r["prompt_tokens"], r["plain_tokens_per_s"]]
            + [r["speculative_tokens_per_s"], r["speedup"], r["ratio_of_medians"]]
            + [f"{r['accepted_tokens']} of {r['draft_tokens']}", r["same_tokens"]]
            for r in rows
        ],
    )


def _compiled_table(report: Report, s: Settings, rows: list[dict]) -> None:
    if not rows:
        return
    eager = rows[0]
    report.add_table(
        f"torch.compile (--torch-compile) of the default variant against eager: cold prefill "
        f"of {s.prompt_len} tokens and batch-1 decode of {s.output_len} tokens, medians of "
        f"{s.repeats}; compile: building the engine and its first request",
        ["variant", "cold prefill tok/s", "decode b1 tok/s", "decode / eager", "compile s"]
        + ["same tokens", "fell back to eager"],
        [
            [r["variant"], r["cold_prefill_tokens_per_s"], r["decode_tokens_per_s"]]
            + [r["decode_tokens_per_s"] / eager["decode_tokens_per_s"], r["compile_s"]]
            + [r["same_tokens"], r["failed"]]
            for r in rows
        ],
    )


def _profile_table(report: Report, runs: list[dict]) -> None:
    kinds = [k.removesuffix(" share") for k in runs[0]["decode_profile"] if k.endswith("share")]
    report.add_table(
        "Where a batch-1 decode step goes (torch.profiler: the ops' own CPU time, and what is "
        "in no op: Python and dispatch; ms per step, share of the profiled step)",
        ["engine", *kinds],
        [[r["name"]] + [_ms_and_share(r["decode_profile"], k) for k in kinds] for r in runs],
    )


def _ms_and_share(profile: dict[str, float], kind: str) -> str:
    return f"{profile[f'{kind} ms/step']:.2f} ({profile[f'{kind} share']:.0%})"


def _notes(s: Settings, peer_note: str | None, peer: "LlamaCppSide | None") -> str:
    notes = [peer_note] if peer_note else []
    if peer is not None:
        notes.append(f"llama.cpp's build and CPU features: `{peer.system_info()}`")
    notes.append(
        f"Perplexity target: a variant that computes with {GGUF_4_BIT} keeps the GGUF file's "
        f"4-bit codes as stored, the weights llama.cpp computes with, so on the same "
        f"{s.perplexity_window}-token windows the two should agree up to rounding (llama.cpp "
        f"also rounds activations to 8 bits in its dot products): Strata / llama.cpp <= "
        f"{PERPLEXITY_TARGET}. Other variants' perplexities are shown, not judged. The "
        f"cached-prefix chunk compares times to the first token; Strata caches whole "
        f"{BLOCK_SIZE}-token blocks and reuses the prefix's last partial block from the request "
        f"that held the prefix (tokens computed: the last column)."
    )
    return "\n\n".join(notes)


def _plot(s: Settings, runs: list[dict], llama: dict | None) -> Figure:
    figure, (left, right) = new_figure(2)
    names = [r["name"] for r in runs]
    if llama:
        labels = ["cold prefill\n(tok/s)", *(f"chunk {c}\n(1 / time)" for c in s.context_lens)]
        labels.append("decode b1\n(tok/s)")
        width = 0.8 / len(runs)
        for i, r in enumerate(runs):
            ratios = r["over_llama_cpp"]
            values = [ratios["cold_prefill_tokens_per_s"], *(1 / v for v in ratios["chunk_s"])]
            values.append(ratios["decode_batch_1_tokens_per_s"])
            left.bar([x + i * width for x in range(len(labels))], values, width, label=names[i])
        left.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=8)
        bounds = [PREFILL_TARGET, *[1 / CHUNK_TARGET] * len(s.context_lens), DECODE_TARGET]
        left.hlines(
            bounds,
            [x - width / 2 for x in range(len(labels))],
            [x + 0.8 for x in range(len(labels))],
            colors="red",
            linestyles="dashed",
            label="target",
        )
        left.axhline(1.0, color="black", linewidth=0.8)
        left.set_yscale("log")
        left.set_ylabel("Strata / llama.cpp speed (log; red: target)")
        left.legend(fontsize="small")
    else:
        left.text(0.5, 0.5, "llama.cpp not measured", ha="center", va="center")
        left.set_axis_off()
    left.set_title("Strata relative to llama.cpp")
    for r, name in zip(runs, names):
        batches = [x["batch_size"] for x in r["decode"]]
        right.plot(batches, [x["decode_tokens_per_s"] for x in r["decode"]], "o-", label=name)
    if llama:
        right.plot([1], [llama["decode"][0]["decode_tokens_per_s"]], "k*", label="llama.cpp")
    right.set_xscale("log", base=2)
    right.set_xticks(list(s.batch_sizes), [str(b) for b in s.batch_sizes])
    right.set_xlabel("batch size")
    right.set_yscale("log")
    right.set_ylabel("median decode tokens/s (log)")
    right.set_title("decode throughput")
    right.legend(fontsize="small")
    return figure
