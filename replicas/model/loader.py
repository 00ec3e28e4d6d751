"""Loads a built-in model, a local Hugging Face directory (config.json, safetensors; see
``replicas.model.hf``) or a GGUF file (see ``replicas.model.gguf``), building the model class
that the architecture's registry entry names (see ``replicas.model.registry``)."""

import logging
import time
from pathlib import Path
from typing import NamedTuple

import torch

from replicas.dtypes import dtype_name_of, torch_dtype
from replicas.model.autotune import (
    Candidate,
    Choice,
    cache_key,
    cache_path,
    candidates,
    tune,
)
from replicas.model.builtin import BUILTIN_MODEL_ARGS, REAL_SHAPE_MODELS, build_builtin_model
from replicas.model.config import ModelArgs
from replicas.model.device_defaults import auto_dtype, device_quantization
from replicas.model.gguf import GGUFWeights, is_gguf_file, open_gguf, read_gguf_info
from replicas.model.hf import SafetensorsWeights, read_hf_info
from replicas.model.native_stack import DECODER_STACKS, load_error, unsupported
from replicas.model.quant import INT4_KERNELS, QUANTIZATIONS
from replicas.model.quantize import quantize_model
from replicas.model.registry import build_model
from replicas.model.resolve import resolve_model
from replicas.model.streamed import (
    KeptFloat,
    Weights,
    build_streamed,
    probe_layers,
    release_freed_memory,
)
from replicas.model.tokenizer import ByteTokenizer, Tokenizer
from replicas.model.transformer import Transformer

logger = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    name: str
    args: ModelArgs
    model: Transformer
    tokenizer: Tokenizer
    quantization: str = "none"  # how the linear weights are kept (replicas.model.quant)
    auto: Choice | None = None  # how ``auto`` was resolved, where it was measured
    decoder_stack: str = "eager"  # how the layers run (replicas.model.native_stack)
    int4_kernel: str = "torch"  # int4's product: torch's or Strata's (replicas.model.quant)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its embedding's, never quantized), and its KV's."""
        return self.model.tok_embeddings.weight.dtype


class _Weights(NamedTuple):
    """A built-in model's weights made in one dtype, before its linear weights are quantized."""

    name: str
    net: Transformer
    tokenizer: Tokenizer
    files: list[str]  # what the weights were read from (the choice cache's key): none


def load_model(
    model: str,
    device: torch.device,
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    revision: str | None = None,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    decoder_stack: str = "auto",
    int4_kernel: str = "auto",
) -> LoadedModel:
    """A built-in model by name (seeded random weights), a packaged model, a local Hugging
    Face directory or a hub id (see ``resolve_model``).

    ``dtype``: a torch dtype, its name, or ``auto``; ``quantization``: ``none`` (weights in
    ``dtype``), ``int8``, ``int4`` or ``auto``. What ``auto`` means is measured on this machine
    (``replicas.model.autotune``, over a KV cache of ``kv_cache_dtype``), except for the
    built-in models, whose random weights exist to test the engine: ``float32`` and ``none``
    there, the reference; on CUDA ``auto`` is bfloat16 and ``none``, and int8 and int4 are
    refused (``replicas.model.device_defaults``). ``decoder_stack``: ``native``, ``eager`` or
    ``auto`` (``replicas.model.native_stack``; for the built-in models, native wherever it can run).
    ``int4_kernel``: ``strata``, ``torch`` or ``auto``, the product of int4 weights (and of the
    int8 weights an int4 model keeps) under the native stack (the eager stack runs torch's).
    A checkpoint's model is built a tensor at a time in the configuration chosen
    (``replicas.model.streamed``); ``auto`` times its candidates on a probe of a few layers.
    The model comes back in eval mode with gradients off.
    """
    if quantization != "auto" and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be auto, none, int8 or int4, got {quantization!r}")
    dtype_name = dtype if isinstance(dtype, str) else dtype_name_of(dtype)
    if dtype_name != "auto":
        torch_dtype(dtype_name)  # a ValueError naming the choices
    resolved = resolve_model(model, revision)
    if decoder_stack not in DECODER_STACKS:
        raise ValueError(f"decoder_stack must be one of {DECODER_STACKS}, got {decoder_stack!r}")
    if int4_kernel not in INT4_KERNELS:
        raise ValueError(f"int4_kernel must be one of {INT4_KERNELS}, got {int4_kernel!r}")
    is_builtin = resolved in BUILTIN_MODEL_ARGS
    if resolved in REAL_SHAPE_MODELS and dtype_name == "auto":
        dtype_name = "bfloat16"  # measured at the size it is served at, never staged in float32
    dtype_name = auto_dtype(dtype_name, device.type, is_builtin)
    quantization = device_quantization(quantization, device.type)
    request = _Request(dtype_name, quantization, decoder_stack, int4_kernel, kv_cache_dtype)
    if is_builtin:
        return _load_builtin(model, resolved, device, seed, request)
    return _load_checkpoint(model, resolved, device, request)


class _Request(NamedTuple):
    """What ``load_model`` was asked for, ``auto`` where it is to be chosen."""

    dtype: str
    quantization: str
    decoder_stack: str
    int4_kernel: str
    kv_cache_dtype: str

    def options(
        self, net: Transformer, device: torch.device, is_quantized: bool, last: bool = False
    ) -> list[Candidate]:
        """The candidates among which ``auto`` chooses for ``net`` (see ``candidates``);
        ``last``: only the last stack and int4 kernel (native and Strata's where they run)."""
        stacks = _stacks(self.decoder_stack, net, device)
        kernels = ("torch",)
        if "native" in stacks and self.int4_kernel != "torch":
            kernels = ("strata",) if self.int4_kernel == "strata" else ("torch", "strata")
        elif self.int4_kernel == "strata":
            raise ValueError(
                "int4_kernel strata runs under the native decoder stack, which this model does "
                f"not take here (decoder_stack {self.decoder_stack})"
            )
        if last:
            stacks, kernels = stacks[-1:], kernels[-1:]
        return candidates(self.dtype, self.quantization, is_quantized, device, stacks, kernels)


def _load_builtin(
    name: str, resolved: str, device: torch.device, seed: int, request: _Request
) -> LoadedModel:
    """A built-in model: random weights made whole in one dtype, then converted (they are
    small, and their random weights are made in one order)."""
    load_dtype = "float32" if request.dtype == "auto" else request.dtype
    weights = _load_weights(name, resolved, device, torch_dtype(load_dtype), seed)
    quantization = "none" if request.quantization == "auto" else request.quantization
    options = request._replace(quantization=quantization).options(weights.net, device, False, True)
    choice = tune(
        options,
        lambda candidate: _finish(weights, candidate, device, copy=True),
        cache_key(weights.files, device, options, request.kv_cache_dtype),
        cache_path(),
        kv_cache_dtype=request.kv_cache_dtype,
        device_type=device.type,
    )
    net = _finish(weights, choice.candidate, device, copy=False)
    return _loaded(net, weights.tokenizer, choice)


def _load_checkpoint(
    name: str, resolved: str, device: torch.device, request: _Request
) -> LoadedModel:
    """A GGUF file or a safetensors directory: ``auto`` measured on a probe (built from the
    probe's tensors alone, one candidate at a time), or read from the choice cache, then the
    chosen configuration built a tensor at a time (``replicas.model.streamed``)."""
    args, tokenizer = _model_info(resolved, name)
    if is_gguf_file(resolved):
        weights: Weights = GGUFWeights(open_gguf(resolved), args, resolved)
    else:
        weights = SafetensorsWeights(Path(resolved), args)
    with torch.device("meta"):
        shape = build_model(args)
    options = request.options(shape, device, weights.is_quantized)
    probe = probe_layers(args, weights.stored_bits)
    spent = {"build": 0.0}
    kept = [KeptFloat(weights, ["tok_embeddings.weight"])]  # the probes' embedding, read once

    def build_probe(candidate: Candidate) -> Transformer:
        release_freed_memory()  # the last probe's
        start = time.perf_counter()
        net = build_streamed(args, kept[0], candidate, device, probe)
        spent["build"] += time.perf_counter() - start
        return net

    start = time.perf_counter()
    choice = tune(
        options,
        build_probe,
        cache_key(weights.files, device, options, request.kv_cache_dtype),
        cache_path(),
        kv_cache_dtype=request.kv_cache_dtype,
        device_type=device.type,
        layers=args.num_layers,
    )
    kept.clear()
    release_freed_memory()
    tuned = time.perf_counter()
    net = build_streamed(args, weights, choice.candidate, device)
    release_freed_memory()  # what the build's temporaries left in the heap
    built = time.perf_counter()
    if choice.source != "fixed":
        logger.info("auto: %s chose %s", name, choice.describe())
    logger.info(
        "loaded %s as %s (%s): %s; model built in %.1f s",
        name,
        choice.candidate,
        choice.source,
        _probe_note(choice, probe, args, spent["build"], tuned - start),
        built - tuned,
    )
    return _loaded(net, tokenizer, choice)


def _probe_note(
    choice: Choice, probe: list[int], args: ModelArgs, build_s: float, tune_s: float
) -> str:
    """What choosing took, for the start-up log."""
    if not choice.source.startswith("measured"):
        return "nothing measured"
    return (
        f"candidates timed on a probe of layers {probe} of {args.num_layers} "
        f"(probes built in {build_s:.1f} s, timed in {tune_s - build_s:.1f} s)"
    )


def _loaded(net: Transformer, tokenizer: Tokenizer, choice: Choice) -> LoadedModel:
    net.use_native_stack(choice.candidate.stack == "native")
    return LoadedModel(
        net.args.name,
        net.args,
        net,
        tokenizer,
        choice.candidate.quantization,
        choice if choice.source != "fixed" else None,
        choice.candidate.stack,
        choice.candidate.kernel,
    )


def _stacks(decoder_stack: str, net: Transformer, device: torch.device) -> tuple[str, ...]:
    """The ways of running ``net``'s layers to choose among: ``native`` last."""
    if decoder_stack == "eager":
        return ("eager",)
    reason = unsupported(net, device) or load_error()
    if reason is None:
        return ("native",) if decoder_stack == "native" else ("eager", "native")
    if decoder_stack == "native":
        raise ValueError(f"decoder_stack native cannot run here: {reason}")
    logger.info("decoder_stack auto: eager (%s)", reason)
    return ("eager",)


def _load_weights(
    name: str, model: str, device: torch.device, dtype: torch.dtype, seed: int
) -> _Weights:
    """The weights of built-in ``model`` in ``dtype``."""
    _, tokenizer = _model_info(model, name)
    net = build_builtin_model(model, seed, device, dtype)
    return _Weights(name, net, tokenizer, [])


def _finish(
    weights: _Weights, candidate: Candidate, device: torch.device, copy: bool
) -> Transformer:
    """The model of ``weights`` in ``candidate``'s dtype and quantization, in eval mode with
    gradients off: built on a copy of the weights (a candidate to time, cast as it is copied) or
    on the weights themselves."""
    dtype = torch_dtype(candidate.dtype)
    if copy:
        net = _empty_model(weights.net.args, device, dtype)
        net.load_state_dict(weights.net.state_dict())
    else:
        net = weights.net.to(dtype)
    if candidate.quantization != "none":
        quantize_model(net, candidate.quantization, int4_kernel=candidate.kernel)
        net.to(device)
    net.eval()
    net.requires_grad_(False)
    return net


def load_model_info(model: str, revision: str | None = None) -> tuple[ModelArgs, Tokenizer]:
    """The model's architecture and tokenizer, without loading any weights."""
    return _model_info(resolve_model(model, revision), model)


def _model_info(model: str, name: str) -> tuple[ModelArgs, Tokenizer]:
    """The info of resolved ``model`` (see ``resolve_model``), named ``name``."""
    if model in BUILTIN_MODEL_ARGS:
        return BUILTIN_MODEL_ARGS[model](), ByteTokenizer()
    if Path(model).is_dir():
        return read_hf_info(Path(model), name)
    if is_gguf_file(model):
        return read_gguf_info(model, name)
    raise ValueError(f"model '{name}' ({model}) is neither a directory nor a .gguf file")


def _empty_model(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> Transformer:
    """The model of ``args`` with uninitialised ``dtype`` weights on ``device``."""
    with torch.device("meta"):
        net = build_model(args)
    net = net.to(dtype=dtype).to_empty(device=device)
    net.tie_weights()
    return net


def checkpoint_bytes(model: str, revision: str | None = None) -> int:
    """Bytes of the files that hold ``model``'s weights (a GGUF file, a directory's
    safetensors); 0 for a built-in model. Resolves ``model`` as ``load_model`` does."""
    resolved = resolve_model(model, revision)
    if resolved in BUILTIN_MODEL_ARGS:
        return 0
    path = Path(resolved)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))
