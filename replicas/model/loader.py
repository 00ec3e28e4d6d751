"""Loads a built-in model, a local Hugging Face directory (config.json, safetensors; see
``replicas.model.hf``) or a GGUF file (see ``replicas.model.gguf``), building the model class
that the architecture's registry entry names (see ``replicas.model.registry``)."""

from pathlib import Path
from typing import NamedTuple

import torch

from replicas.model.builtin import BUILTIN_MODEL_ARGS, build_builtin_model
from replicas.model.config import ModelArgs
from replicas.model.gguf import (
    gguf_model_info,
    is_gguf_file,
    load_gguf_weights,
    open_gguf,
    read_gguf_info,
)
from replicas.model.hf import load_safetensors, read_hf_info
from replicas.model.registry import build_model
from replicas.model.resolve import resolve_model
from replicas.model.tokenizer import ByteTokenizer, Tokenizer
from replicas.model.transformer import Transformer


class LoadedModel(NamedTuple):
    name: str
    args: ModelArgs
    model: Transformer
    tokenizer: Tokenizer


def load_model(
    model: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    revision: str | None = None,
) -> LoadedModel:
    """A built-in model by name (seeded random weights), a packaged model, a local Hugging
    Face directory or a hub id (see ``resolve_model``).

    The model comes back in eval mode with gradients off.
    """
    name = model
    model = resolve_model(model, revision)
    if is_gguf_file(model):
        reader = open_gguf(model)
        args, tokenizer = gguf_model_info(reader, name)
        net = _empty_model(args, device, dtype)
        load_gguf_weights(net, reader, model)
    else:
        args, tokenizer = _model_info(model, name)
        if model in BUILTIN_MODEL_ARGS:
            net = build_builtin_model(model, seed).to(device=device, dtype=dtype)
        else:
            net = _empty_model(args, device, dtype)
            load_safetensors(net, Path(model))
    net.eval()
    net.requires_grad_(False)
    return LoadedModel(name=net.args.name, args=net.args, model=net, tokenizer=tokenizer)


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
