"""The decoder stack as one native loop: the layers' ATen ops called from C++, not from Python.

A batch-1 decode step of a small model is a few dozen small ops per layer, and on a CPU much of
the step is the Python interpreter walking the modules and calling each op (profiled:
docs/design.md section 12, "Native decoder stack"). A GPU replays such a step as a CUDA graph;
here ``native_stack.cpp`` walks the same layers in C++, calling the very ATen ops the eager
model calls, in the same order with the same arguments (for a few decode rows, RMSNorm, the
rotary embedding and the KV write are single loops that round exactly where those ops round).
So nothing rounds differently: its outputs are bitwise eager's
(``tests/unit/model/test_native_stack.py`` compares them for every dtype, quantization and
layer variant, prefill and decode), and prefix caching, batching and speculative decoding give
the outputs they give eager. That is what sets it apart from ``torch.compile``
(``replicas.model.compiled``), whose fused chains round once where eager rounds after each op.

Scope: models whose layers are all full attention (the Llama, Qwen2 and Qwen3 families; a
model with sliding-window layers runs eager), on a CPU, with a KV cache of values (an 8-bit KV
format runs eager). Attention takes every path of ``replicas.model.attention`` for such a cache: one
SDPA call per group of one chunk, the online softmax over chunks of a long context, several
groups in one batch (prefill chunks beside decodes, draft tokens attending alone).

Whether it runs is ``decoder_stack``: ``auto`` (``replicas.model.autotune`` times each candidate
both ways at start-up and keeps the faster), ``native`` or ``eager``. The library is compiled at
first use, against the installed torch's headers, with the C++ compiler ``CXX`` names (else ``c++``;
docs/design.md section 12 says how long it takes), into ``$XDG_CACHE_HOME/strata/native/<key>/``
(``~/.cache`` by default; ``STRATA_NATIVE_DIR`` names another folder), the key hashing the source's
text (not its path: a copy of the checkout, such as a Ray job's working directory, loads the same
build), torch's version and the compiler, so a restart loads it at once and an upgrade of torch
rebuilds it; builds of other sources that no process has loaded for 30 days are removed. Builds are
serialised by a lock beside it, so replicas starting together build it once. Where it cannot be
built (no compiler, a failed build), ``auto`` runs eager and logs why; ``native`` fails at start-up
saying why.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

import torch
from torch import nn

from replicas.model.attention import AttentionMetadata
from replicas.model.mixed import MixedLinear
from replicas.model.quant import QuantizedLinear

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_stack.cpp")
SOURCES = tuple(
    SOURCE.with_name(name)
    for name in (
        "native_stack.cpp",
        "native_linear.h",
        "attention_plan.h",
        "quantized_mm.cpp",
        "quantized_mm4.cpp",
        "quantized_mm8.cpp",
        "quantized_mm6.cpp",
        "quantized_mm2.cpp",
        "quantized_mm.h",
        "quantized_rows.h",
        "decode_attention.cpp",
        "decode_attention.h",
        "attention_kernel.h",
        "attention_lanes.h",
        "native_isa.h",
        "weight_packing.cpp",
        "weight_packing.h",
    )
)
"""What the library is built from (the key of its folder hashes them all)."""
DIR_ENV = "STRATA_NATIVE_DIR"
ISA_ENV = "STRATA_NATIVE_ISA"
"""Caps the native kernels' instruction path (native_isa.h), to time a lesser CPU's paths here."""
ISA_CAPS = ("amx", "avx512", "avx2", "scalar")
DECODER_STACKS = ("auto", "native", "eager")
# native_linear.h's LinearKind
_KINDS = {"none": 0, "int8": 1, "int4": 2, "int4/strata": 3, "int8/strata": 4, "mixed/strata": 5}


@cache
def load_error() -> str | None:
    """Why the native library cannot be used in this process, or None once it is loaded
    (built first where no build of this source, torch and compiler is cached). An
    ``STRATA_NATIVE_ISA`` that names no instruction path is a ``ValueError``."""
    cap = os.environ.get(ISA_ENV)
    if cap is not None and cap not in ISA_CAPS:
        raise ValueError(f"{ISA_ENV}={cap!r} names no instruction path; use one of {ISA_CAPS}")
    try:
        library = _built_library()
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        reason = f"{type(error).__name__}: {error}".strip()
        logger.warning("native decoder stack unavailable (the model runs eager): %s", reason)
        return reason
    return None


def is_loaded() -> bool:
    """Whether this process has loaded the library (``load_error`` ran and succeeded); never
    builds it."""
    return load_error.cache_info().currsize > 0 and load_error() is None


def unsupported(model: nn.Module, device: torch.device) -> str | None:
    """Why ``model`` cannot run natively on ``device``, or None where it can (if it loads)."""
    if device.type != "cpu":
        return f"the native decoder stack runs on a CPU, not {device.type}"
    if any(group != "full" for group in model.args.layer_types):
        return "the native decoder stack runs models of full-attention layers only"
    return None


class NativeStack:
    """A model's decoder layers and final norm as one ``strata_native::DecoderStack``, built
    at its first forward on the model's own weight tensors (nothing is copied): a model whose
    weights are replaced afterwards calls ``Transformer.use_native_stack`` again. A deep copy
    of a model gets a stack of its own, built on the copy's weights at its first forward."""

    def __init__(self) -> None:
        self._stack = None

    def __deepcopy__(self, memo: dict) -> "NativeStack":
        return NativeStack()

    @staticmethod
    def accepts(metas: dict[str, AttentionMetadata]) -> AttentionMetadata | None:
        """The forward's metadata where this forward can run natively (one cache group of
        full attention, K/V stored as values), else None."""
        meta = metas.get("full")
        if meta is None or len(metas) != 1:
            return None
        if meta.kv_format is not None and meta.kv_format.is_quantized:
            return None
        return meta

    def __call__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``run_layers`` of ``model`` for a forward ``accepts`` took: the final-norm hidden
        states."""
        if self._stack is None:
            tensors, ints = _pack(model)
            eps = float(model.args.rms_norm_eps)
            self._stack = torch.classes.strata_native.DecoderStack(tensors, ints, eps)
        args = model.args
        layout = meta.layout_for(kv_cache, args.num_heads // args.num_kv_heads, args.head_dim)
        ints, tensors = _attention_plan(meta)
        return self._stack.forward(
            x, cos, sin, kv_cache, layout.write_rows, meta.is_one_group, ints, tensors
        )


def _attention_plan(meta: AttentionMetadata) -> tuple[list[int], list[torch.Tensor]]:
    """The forward's attention groups, chunks and partials (its layout, computed) as
    ``unpack_groups`` reads them."""
    ints, tensors = [len(meta.groups)], []
    for group, reads in zip(meta.groups, meta.layout.reads, strict=True):
        is_slice = isinstance(group.rows, slice)
        start, end = (group.rows.start, group.rows.stop) if is_slice else (0, -1)
        ints += [start, end, group.num_seqs, group.q_len, group.is_causal]
        ints += [group.allowed is not None, len(group.chunks)]
        if not is_slice:
            tensors.append(group.rows)
        if group.allowed is not None:
            tensors.append(group.allowed)
        combined = len(group.chunks) > 1  # biases and partials exist only then
        for i, chunk in enumerate(group.chunks):
            bias = reads.biases[i] if combined else None
            queries = reads.queries[i]
            ints += [chunk.num_seqs, queries.start, queries.stop, bias is not None]
            tensors.append(reads.rows[i])
            if bias is not None:
                tensors.append(bias)
            if combined:
                tensors.extend(reads.partials[i])
        if combined:
            tensors += [reads.m_all, reads.l_all, reads.o_all]
    return ints, tensors


def _pack(model: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """The stack's weights and shapes as ``DecoderStack``'s constructor reads them."""
    args = model.args
    tensors: list[torch.Tensor] = []
    ints = [len(model.layers), args.num_heads, args.num_kv_heads, args.head_dim]

    def linear(module: nn.Module) -> None:
        if isinstance(module, MixedLinear):
            ints.extend([_KINDS["mixed/strata"], module.in_features, module.out_features])
            ints.extend([module.bias is not None, module.passes, len(module.parts)])
            for part in module.parts:
                ints.extend([part.scheme == "int4", part.out_features])
                tensors.extend([part.weight.detach(), part.scales])
            if module.bias is not None:
                tensors.append(module.bias.detach())
            return
        if isinstance(module, QuantizedLinear):
            name = f"{module.scheme}/strata" if module.kernel == "strata" else module.scheme
            kind, extra = _KINDS[name], [module.scales]
        elif isinstance(module, nn.Linear):
            kind, extra = _KINDS["none"], []
        else:
            raise TypeError(f"the native decoder stack has no product for {type(module)}")
        passes = getattr(module, "passes", 2)  # only Strata's products read it
        ints.extend(
            [kind, module.in_features, module.out_features, module.bias is not None, passes]
        )
        tensors.extend([module.weight.detach(), *extra])
        if module.bias is not None:
            tensors.append(module.bias.detach())

    for layer in model.layers:
        attention, ff = layer.attention, layer.feed_forward
        qkv = (
            [attention.wqkv]
            if attention.wqkv is not None
            else [
                attention.wq,
                attention.wk,
                attention.wv,
            ]
        )
        gate_up = [ff.w13] if ff.w13 is not None else [ff.w1, ff.w3]
        ints.extend([len(qkv), len(gate_up), attention.q_norm is not None])
        for module in [*qkv, attention.wo, *gate_up, ff.w2]:
            linear(module)
        tensors.extend([layer.attention_norm.weight.detach(), layer.ffn_norm.weight.detach()])
        if attention.q_norm is not None:
            tensors.extend([attention.q_norm.weight.detach(), attention.k_norm.weight.detach()])
    tensors.append(model.norm.weight.detach())
    return tensors, ints


def _built_library() -> Path:
    """The compiled library of ``SOURCE`` for this torch and compiler, built where missing."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise OSError(f"no C++ compiler ({compiler!r}; set CXX to name one)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[0]
    command = _compile_command(compiler)
    # The sources by their text and name, not where they lie: a copy of this checkout (the
    # working directory of a ``ray job submit``) takes the build of the original.
    where = {str(path): path.name for path in SOURCES}
    key = hashlib.sha256(
        "\n".join(
            [
                *(path.read_text() for path in SOURCES),
                torch.__version__,
                version,
                *(where.get(part, part) for part in command),
            ]
        ).encode()
    ).hexdigest()[:16]
    folder = _native_dir() / key
    library = folder / "native_stack.so"
    if library.exists():
        _forget_unused_builds(folder)
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built by another process while this one waited
            return library
        logger.info("native library: compiling %s (once per torch and compiler)", SOURCE.parent)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            partial = Path(scratch) / library.name
            result = _compile(command, partial)
            if result.returncode != 0 and OPENMP in command:
                # A compiler without OpenMP (clang without libomp): the int4 product runs on
                # one thread, everything else as before.
                logger.info("native library: compiling without OpenMP (%s failed)", OPENMP)
                result = _compile([c for c in command if c != OPENMP], partial)
            if result.returncode != 0:
                errors = [line for line in result.stderr.splitlines() if "error" in line]
                raise RuntimeError(f"compiling {SOURCE.name} failed: {' | '.join(errors[:3])}")
            os.replace(partial, library)
    _forget_unused_builds(folder)
    return library


UNUSED_BUILD_S = 30 * 24 * 3600
"""A build of other sources (an older checkout) not loaded for this long is removed."""


def _forget_unused_builds(current: Path) -> None:
    """Marks ``current`` as used now and removes the builds beside it that no process has
    loaded for ``UNUSED_BUILD_S`` (one is left per source change otherwise)."""
    now = time.time()
    with contextlib.suppress(OSError):
        os.utime(current, (now, now))
    with contextlib.suppress(OSError):
        for folder in current.parent.iterdir():
            if folder != current and folder.is_dir():
                if now - folder.stat().st_mtime > UNUSED_BUILD_S:
                    shutil.rmtree(folder, ignore_errors=True)


OPENMP = "-fopenmp"  # torch's own libgomp serves it at run time (already loaded, same soname)


def _compile(command: list[str], output: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command, "-o", str(output)], capture_output=True, text=True, timeout=600
    )


def _compile_command(compiler: str) -> list[str]:
    from torch.utils import cpp_extension

    lib_dir = cpp_extension.library_paths()[0]
    return [
        compiler,
        "-O2",
        "-ffp-contract=off",  # no fused multiply-add: fused passes round as ATen's ops do
        OPENMP,
        "-std=c++20",
        "-fPIC",
        "-shared",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        *(str(path) for path in SOURCES if path.suffix == ".cpp"),
        f"-L{lib_dir}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        f"-Wl,-rpath,{lib_dir}",
    ]


def _native_dir() -> Path:
    configured = os.environ.get(DIR_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "strata" / "native"
