"""The native decoder stack (``replicas.model.native_stack``) against the eager model it
mirrors: bitwise the same hidden states and KV cache, for every dtype, quantization and layer
variant, over prefill chunks and batches of decodes; forwards outside its scope run eager; an
engine gives eager's greedy tokens with it, prefix caching on and off; without a compiler,
``auto`` runs eager and ``native`` fails at start-up naming the option."""

import copy
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from cluster import LLM, SamplingParams
from replicas.config import PrefixCacheConfig, SchedulerConfig
from replicas.model import loader, native_stack
from replicas.model.attention import AttentionMetadata, strata_attends
from replicas.model.batch import ForwardBatch
from replicas.model.builtin import BUILTIN_MODEL_ARGS, init_random_weights
from replicas.model.mixed import MixedLinear
from replicas.model.quant import QuantizedLinear, int4_fits
from replicas.model.quantize import quantize_model
from replicas.model.registry import build_model

if native_stack.load_error() is not None:  # pragma: no cover - a machine without a compiler
    pytest.skip(f"no native stack here: {native_stack.load_error()}", allow_module_level=True)

BLOCK = 16
BLOCKS_PER_SEQ = 112  # past ONE_CHUNK_BLOCKS: a long context (in chunks where SDPA serves)


def model_of(args, dtype: torch.dtype, quantization: str, seed: int = 0):
    model = build_model(args)
    init_random_weights(model, seed)
    model = model.to(dtype)
    if quantization == "int4-mixed":  # Strata's int4, each layer's q/k/v of three layouts
        return mixed_qkv(model_of(args, dtype, "int4-strata", seed))
    if quantization != "none":  # int4-strata: int4 through Strata's kernel
        scheme, _, kernel = quantization.partition("-")
        # as if stored at 4 bits: a float checkpoint's weights would be kept at int8; one
        # block's down projection as if stored at 8 bits, kept at int8 (under int4-strata,
        # through Strata's int8 kernel inside the stack, as the LM head is outside it)
        bits = {name: 4 for name, _ in model.named_parameters()}
        bits["layers.0.feed_forward.w2.weight"] = 8
        quantize_model(model, scheme, stored_bits=bits, int4_kernel=kernel or "torch")
        if scheme == "int4":
            kinds = {(m.scheme, m.kernel) for m in model.modules() if hasattr(m, "scheme")}
            assert kinds == {("int4", kernel or "torch"), ("int8", kernel or "torch")}, kinds
    return model.eval().requires_grad_(False)


def mixed_qkv(model):
    """``model`` with each layer's q/k/v one ``MixedLinear``: q at int4, k at int8 and v at int4
    again (int8 where int4 does not take its shape), from the values of its int4 product."""
    for layer in model.layers:
        wqkv = layer.attention.wqkv
        weights = wqkv.dequantized(torch.float32).split(layer.attention.qkv_sizes)
        biases = [None] * 3 if wqkv.bias is None else wqkv.bias.split(layer.attention.qkv_sizes)
        make = [
            QuantizedLinear.int4 if i != 1 and int4_fits(*w.shape) else QuantizedLinear.int8
            for i, w in enumerate(weights)
        ]
        layer.attention.wqkv = MixedLinear(
            [f(w, b, "strata", wqkv.passes) for f, w, b in zip(make, weights, biases)]
        )
    return model


VARIANTS = {
    "llama": BUILTIN_MODEL_ARGS["tiny"](),
    "qwen2 (q/k/v biases)": replace(BUILTIN_MODEL_ARGS["tiny"](), attention_bias=True),
    "qwen3 (q/k norms)": replace(BUILTIN_MODEL_ARGS["tiny"](), qk_norm=True),
    "head size 40 (SDPA and chunks)": replace(BUILTIN_MODEL_ARGS["tiny"](), head_dim=40),
}


class Sequences:
    """Sequences over private blocks of one cache: sequence i owns ``BLOCKS_PER_SEQ`` blocks."""

    def __init__(self, count: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 256, (count, BLOCKS_PER_SEQ * BLOCK), generator=gen)
        self.table = torch.arange(count * BLOCKS_PER_SEQ).view(count, BLOCKS_PER_SEQ)

    def batch(self, spans: list[tuple[int, int, int]], solo: int = 0) -> ForwardBatch:
        """Entry ``(i, start, end)``: sequence i computes positions start .. end - 1."""
        ids, positions, slots, starts = [], [], [], [0]
        for i, start, end in spans:
            pos = torch.arange(start, end)
            ids.append(self.tokens[i, start:end])
            positions.append(pos)
            slots.append(self.table[i, pos // BLOCK] * BLOCK + pos % BLOCK)
            starts.append(starts[-1] + end - start)
        return ForwardBatch(
            input_ids=torch.cat(ids),
            positions=torch.cat(positions),
            query_start_loc=starts,
            seq_lens=[end for _, _, end in spans],
            block_tables={"full": self.table[[i for i, _, _ in spans]]},
            slot_mapping={"full": torch.cat(slots)},
            logits_indices=torch.tensor([s - 1 for s in starts[1:]]),
            num_solo_seqs=solo,
        )


def run_both(model, num_seqs: int, batches, kv_cache_dtype: str = "auto"):
    """Each forward of ``batches`` in turn, eager on one cache and native on another."""
    spec = model.kv_cache_specs(model.tok_embeddings.weight.dtype, kv_cache_dtype)["full"]
    shape = spec.shape(num_seqs * BLOCKS_PER_SEQ, BLOCK)
    caches = {
        mode: {"full": torch.zeros(shape, dtype=spec.storage_dtype)} for mode in ("eager", "native")
    }
    outputs = {"eager": [], "native": []}
    with torch.inference_mode():
        for batch in batches:
            for mode in ("eager", "native"):
                model.use_native_stack(mode == "native")
                outputs[mode].append(model(batch, caches[mode], spec.kv_format))
    model.use_native_stack(False)
    return outputs, caches


def metas(batch, kv_format=None, whole_spans=False):
    return {"full": AttentionMetadata.build(batch, "full", BLOCK, None, kv_format, whole_spans)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "dtype, quantization",
    [
        (torch.float32, "none"),
        (torch.bfloat16, "none"),
        (torch.float32, "int8"),
        (torch.bfloat16, "int4"),
        (torch.float32, "int4-strata"),
        (torch.bfloat16, "int4-strata"),
        (torch.float32, "int4-mixed"),
    ],
)
def test_native_equals_eager_bitwise(variant, dtype, quantization):
    model = model_of(VARIANTS[variant], dtype, quantization)
    seqs = Sequences(3, seed=1)
    batches = [
        seqs.batch([(0, 0, 37)]),  # a prefill chunk from position 0: causal
        seqs.batch([(1, 0, 20)]),  # another sequence alone
        seqs.batch([(0, 37, 50)]),  # a chunk after cached context: masked
        seqs.batch([(0, 50, 51), (1, 20, 21)]),  # two decodes of different lengths: padded
        seqs.batch([(0, 51, 52)]),  # one decode
        seqs.batch([(1, 21, 22), (2, 0, 30)]),  # a decode beside a prefill chunk: two groups
        seqs.batch([(0, 52, 53), (0, 53, 54), (1, 22, 23)], solo=2),  # draft tokens: solo
        seqs.batch([(2, 30, 1700)]),  # a long chunk: its later rows see two chunks of keys
        seqs.batch([(2, 1700, 1701), (0, 54, 55)]),  # decodes over 107 and 4 blocks
    ]
    # Every attention path is taken: Strata's attention over whole spans (head size a multiple
    # of 16), else SDPA over one chunk and the online softmax over several.
    whole = strata_attends(torch.device("cpu"), None, VARIANTS[variant].head_dim)
    groups = [len(metas(b, None, whole)["full"].groups) for b in batches]
    chunks = [max(len(g.chunks) for g in metas(b, None, whole)["full"].groups) for b in batches]
    assert groups[5:7] == [2, 3] and (max(chunks) == 1 if whole else min(chunks[7:]) > 1)
    calls = []
    native_call = native_stack.NativeStack.__call__

    def counted(self, *args):
        calls.append(args[-1])
        return native_call(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_stack.NativeStack, "__call__", counted)
        outputs, caches = run_both(model, 3, batches)
    assert len(calls) == len(batches)  # every one of them ran natively
    for eager, native in zip(outputs["eager"], outputs["native"], strict=True):
        assert torch.equal(eager, native)
    assert torch.equal(caches["eager"]["full"], caches["native"]["full"])
    assert outputs["eager"][-1].abs().sum() > 0


@pytest.mark.parametrize("native", [False, True], ids=["eager", "native"])
@pytest.mark.parametrize(
    "dtype, quantization", [(torch.float32, "int4-strata"), (torch.bfloat16, "none")]
)
def test_a_prompt_gives_the_same_bits_whole_after_a_cached_prefix_and_as_decodes(
    native, dtype, quantization
):
    """What prefix caching on and off needs: a position's hidden state and K/V are the same bits
    whether its prompt ran whole, as chunks after cached keys, or token by token as decodes
    (sequence 1 repeats sequence 0's tokens; its context runs past ONE_CHUNK_BLOCKS)."""
    if quantization == "int4-strata" and not native:
        pytest.skip("Strata's int4 kernel runs under the native stack only")
    model = model_of(VARIANTS["llama"], dtype, quantization)
    seqs = Sequences(2, seed=4)
    seqs.tokens[1] = seqs.tokens[0]
    end = 1700
    whole = [seqs.batch([(0, 0, end)])]
    split = [seqs.batch([(1, 0, 600)]), seqs.batch([(1, 600, end - 3)])]
    split += [seqs.batch([(1, p, p + 1)]) for p in range(end - 3, end)]
    spec = model.kv_cache_specs(dtype, "auto")["full"]
    cache = {"full": torch.zeros(spec.shape(2 * BLOCKS_PER_SEQ, BLOCK), dtype=spec.storage_dtype)}
    model.use_native_stack(native)
    try:
        with torch.inference_mode():
            hidden_whole = model(whole[0], cache, spec.kv_format)
            hidden_split = torch.cat([model(b, cache, spec.kv_format) for b in split])
    finally:
        model.use_native_stack(False)
    assert torch.equal(hidden_whole, hidden_split)
    assert not torch.equal(hidden_whole[:600], hidden_split[600:1200])  # not a vacuous check
    blocks = -(-end // BLOCK)
    assert torch.equal(
        cache["full"][:blocks], cache["full"][BLOCKS_PER_SEQ : BLOCKS_PER_SEQ + blocks]
    )


def test_only_an_8_bit_kv_cache_or_a_second_cache_group_runs_eager():
    model = model_of(VARIANTS["llama"], torch.bfloat16, "int4")
    seqs = Sequences(2, seed=2)
    accepts = native_stack.NativeStack.accepts
    assert accepts(metas(seqs.batch([(0, 0, 30), (1, 0, 12)]))) is not None
    int8_kv = model.kv_cache_specs(torch.bfloat16, "int8")["full"].kv_format
    assert accepts(metas(seqs.batch([(0, 0, 8)]), int8_kv)) is None
    assert accepts({**metas(seqs.batch([(0, 0, 8)])), "sliding": None}) is None
    # Where it runs eager, the result is eager's: the same forwards, 8-bit KV.
    batches = [seqs.batch([(0, 0, 30)]), seqs.batch([(0, 30, 31), (1, 0, 5)])]
    outputs, _ = run_both(model, 2, batches, kv_cache_dtype="int8")
    for eager, native in zip(outputs["eager"], outputs["native"], strict=True):
        assert torch.equal(eager, native)


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PREFIX = "The lighthouse keeper climbed the stairs at dusk and lit the lamp. " * 3
PROMPTS = [PREFIX + "Then", PREFIX + "A ship appeared on the horizon and", "Hello"]


def test_an_engine_gives_eager_tokens_natively_with_caching_on_and_off():
    no_cache = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))
    engines = {
        "native": LLM("tiny", dtype="bfloat16", seed=3),  # a built-in model: native
        "eager": LLM("tiny", dtype="bfloat16", seed=3, decoder_stack="eager"),
        "native, no cache": LLM("tiny", dtype="bfloat16", seed=3, scheduler_config=no_cache),
    }
    try:
        assert engines["native"].engine.config.decoder_stack == "native"
        assert engines["eager"].engine.loaded.model.native is None
        runs = {}
        for name, llm in engines.items():
            batched = [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)]
            alone = [list(llm.generate(p, GREEDY).token_ids) for p in PROMPTS]
            runs[name] = (batched, alone)
        assert runs["native"] == runs["eager"] == runs["native, no cache"]
        assert engines["native"].generate(PROMPTS[0], GREEDY).num_cached_tokens > 0
    finally:
        for llm in engines.values():
            llm.shutdown()


def test_strata_int4_engine_tokens_are_the_same_with_caching_on_and_off():
    """Strata's int4 kernel computes each row alone, so a prompt's tokens do not depend on what
    is cached, chunked or batched beside it; it runs under the native stack only."""
    from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path

    try:
        smollm2 = str(packaged_model_path(DEFAULT_MODEL))
    except ValueError as missing:
        pytest.skip(str(missing))
    no_cache = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))
    options = {"dtype": "float32", "quantization": "int4", "int4_kernel": "strata", "seed": 3}
    engines = {
        "cache": LLM(smollm2, **options),
        "no cache": LLM(smollm2, **options, scheduler_config=no_cache),
    }
    try:
        config = engines["cache"].engine.config
        assert (config.quantization, config.int4_kernel) == ("int4", "strata")
        wqkv = engines["cache"].engine.loaded.model.layers[0].attention.wqkv
        assert wqkv.kernel == "strata"
        runs = {}
        for name, llm in engines.items():
            batched = [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)]
            alone = [list(llm.generate(p, GREEDY).token_ids) for p in PROMPTS]
            runs[name] = (batched, alone)
        assert runs["cache"] == runs["no cache"]
        assert runs["cache"][0] == runs["cache"][1]
        assert engines["cache"].generate(PROMPTS[0], GREEDY).num_cached_tokens > 0
    finally:
        for llm in engines.values():
            llm.shutdown()
    with pytest.raises(ValueError, match="int4_kernel strata runs under the native decoder"):
        loader.load_model(
            "tiny",
            torch.device("cpu"),
            quantization="int4",
            decoder_stack="eager",
            int4_kernel="strata",
        )
    with pytest.raises(ValueError, match="int4_kernel must be one of"):
        loader.load_model("tiny", torch.device("cpu"), int4_kernel="fast")


def test_a_compiler_without_openmp_still_builds_the_library(monkeypatch, tmp_path):
    """-fopenmp only threads the int4 product: where the compiler refuses it (clang without
    libomp), the library is built without it (the compiler stubbed: the real build runs in
    every other test)."""
    import subprocess

    commands = []

    def compile_(command, output):
        commands.append(command)
        if native_stack.OPENMP in command:
            return subprocess.CompletedProcess(command, 1, "", "error: unsupported -fopenmp")
        output.write_bytes(b"library")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(native_stack, "_compile", compile_)
    monkeypatch.setenv(native_stack.DIR_ENV, str(tmp_path))
    library = native_stack._built_library()
    assert library.read_bytes() == b"library"
    assert [native_stack.OPENMP in c for c in commands] == [True, False]
    assert commands[1] == [c for c in commands[0] if c != native_stack.OPENMP]


def test_a_copy_of_the_sources_loads_the_same_build_and_unused_builds_are_removed(
    monkeypatch, tmp_path
):
    """The build's key is the sources' text, not their folder (a Ray job's working directory
    is a copy of the checkout); builds nobody loaded for 30 days are removed, others kept."""
    import os
    import shutil
    import subprocess
    import time

    builds = []

    def compile_(command, output):
        builds.append(command)
        output.write_bytes(b"library")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(native_stack, "_compile", compile_)
    monkeypatch.setenv(native_stack.DIR_ENV, str(tmp_path / "builds"))
    old, recent = tmp_path / "builds" / "old", tmp_path / "builds" / "recent"
    for folder in (old, recent):
        folder.mkdir(parents=True)
    long_ago = time.time() - native_stack.UNUSED_BUILD_S - 60
    os.utime(old, (long_ago, long_ago))
    library = native_stack._built_library()
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in native_stack.SOURCES:
        shutil.copy(path, copy / path.name)
    monkeypatch.setattr(native_stack, "SOURCES", [copy / p.name for p in native_stack.SOURCES])
    assert native_stack._built_library() == library
    assert len(builds) == 1  # the copy loaded the first build
    assert not old.exists() and recent.exists()
    (copy / native_stack.SOURCES[0].name).write_text("// changed\n")
    assert native_stack._built_library() != library and len(builds) == 2


def test_without_a_compiler_auto_runs_eager_and_native_fails_naming_the_option(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv(native_stack.DIR_ENV, str(tmp_path))
    with pytest.raises(OSError, match=r"no C\+\+ compiler"):
        native_stack._built_library()
    monkeypatch.setattr(loader, "load_error", lambda: "OSError: no C++ compiler")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="decoder_stack native cannot run here: OSError"):
        loader.load_model("tiny", cpu, decoder_stack="native")
    loaded = loader.load_model("tiny", cpu, decoder_stack="auto")
    assert loaded.decoder_stack == "eager" and loaded.model.native is None
    # A hybrid model's sliding layers run eager whatever the library.
    monkeypatch.setattr(loader, "load_error", lambda: None)
    with pytest.raises(ValueError, match="full-attention layers only"):
        loader.load_model("tiny-hybrid", cpu, decoder_stack="native")
    assert loader.load_model("tiny-hybrid", cpu).decoder_stack == "eager"
    with pytest.raises(ValueError, match="decoder_stack must be one of"):
        loader.load_model("tiny", cpu, decoder_stack="fast")


def test_the_instruction_path_cap_holds_every_kernel_and_a_bad_one_fails_naming_it(monkeypatch):
    """``STRATA_NATIVE_ISA=avx2`` keeps both native kernels at most on their AVX2 paths (read
    once per process, so in a fresh one); a value that names no path fails before loading."""
    script = (
        "import torch; from replicas.model import native_stack; native_stack.load_error(); "
        "print(torch.ops.strata_native.quantized_mm_path(), "
        "torch.ops.strata_native.decode_attention_path())"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, native_stack.ISA_ENV: "avx2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    products, attention = map(int, run.stdout.split())
    assert products == min(1, torch.ops.strata_native.quantized_mm_path())
    assert attention == min(1, torch.ops.strata_native.decode_attention_path())
    monkeypatch.setenv(native_stack.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match="STRATA_NATIVE_ISA='avx9'"):
        native_stack.load_error.__wrapped__()


def test_a_deep_copy_runs_natively_on_its_own_weights():
    model = model_of(VARIANTS["llama"], torch.float32, "none")
    seqs = Sequences(1, seed=4)
    model.use_native_stack(True)
    spec = model.kv_cache_specs(torch.float32)["full"]

    def forward(net):
        cache = {"full": torch.zeros(spec.shape(BLOCKS_PER_SEQ, BLOCK))}
        return net(seqs.batch([(0, 0, 20)]), cache)

    with torch.inference_mode():
        before = forward(model)
        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.mul_(0.5)
        assert torch.equal(forward(model), before)
        native = forward(twin)
        twin.use_native_stack(False)
        eager = forward(twin)
    assert torch.equal(native, eager) and not torch.equal(native, before)
