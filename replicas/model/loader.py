"""Loads a built-in model, a local Hugging Face directory (config.json, safetensors; see
``replicas.model.hf``) or a GGUF file (see ``replicas.model.gguf``), building the model class
that the architecture's registry entry names (see ``replicas.model.registry``)."""

from pathlib import Path
from typing import NamedTuple

import torch

from replicas.model.builtin import BUILTIN_MODEL_ARGS, build_builtin_model
from replicas.model.config import ModelArgs
from replicas.model.gguf import (
    gguf_int4_groups,
    gguf_model_info,
    gguf_weight_bits,
    is_gguf_file,
    load_gguf_weights,
    open_gguf,
    read_gguf_info,
)
from replicas.model.hf import load_safetensors, read_hf_info
from replicas.model.quant import QUANTIZATIONS, default_quantization, quantize_model
from replicas.model.registry import build_model
from replicas.model.resolve import resolve_model
from replicas.model.tokenizer import ByteTokenizer, Tokenizer
from replicas.model.transformer import Transformer


class LoadedModel(NamedTuple):
    name: str
    args: ModelArgs
    model: Transformer
    tokenizer: Tokenizer
    quantization: str = "none"  # how the linear weights are kept (replicas.model.quant)


def load_model(
    model: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    revision: str | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """A built-in model by name (seeded random weights), a packaged model, a local Hugging
    Face directory or a hub id (see ``resolve_model``).

    ``quantization``: ``none`` (weights in ``dtype``), ``int8``, ``int4`` or ``auto``
    (``replicas.model.quant.default_quantization``). The model comes back in eval mode with
    gradients off.
    """
    if quantization != "auto" and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be auto, none, int8 or int4, got {quantization!r}")
    name = model
    model = resolve_model(model, revision)
    int4_groups, stored_bits = {}, {}
    if is_gguf_file(model):
        reader = open_gguf(model)
        args, tokenizer = gguf_model_info(reader, name)
        net = _empty_model(args, device, dtype)
        load_gguf_weights(net, reader, model)
        stored_bits = gguf_weight_bits(net, reader)
        if quantization == "auto":
            is_quantized = any(bits <= 8 for bits in stored_bits.values())
            quantization = default_quantization(device, is_quantized)
        if quantization == "int4":
            int4_groups = gguf_int4_groups(net, reader)
    else:
        args, tokenizer = _model_info(model, name)
        if model in BUILTIN_MODEL_ARGS:
            net = build_builtin_model(model, seed).to(device=device, dtype=dtype)
        else:
            net = _empty_model(args, device, dtype)
            load_safetensors(net, Path(model))
    if quantization == "auto":  # not a GGUF file: a float checkpoint
        quantization = default_quantization(device, is_quantized_checkpoint=False)
    if quantization != "none":
        quantize_model(net, quantization, int4_groups, stored_bits)
        net.to(device)
    net.eval()
    net.requires_grad_(False)
    return LoadedModel(net.args.name, net.args, net, tokenizer, quantization)


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
