"""Loads a built-in model, a local Hugging Face directory (config.json, safetensors) or a GGUF
file (see ``replicas.model.gguf``)."""

import json
import re
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
from replicas.model.resolve import resolve_model
from replicas.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
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
        return _read_hf_config(Path(model), name)
    if is_gguf_file(model):
        return read_gguf_info(model, name)
    raise ValueError(f"model '{name}' ({model}) is neither a directory nor a .gguf file")


def _empty_model(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> Transformer:
    """A Transformer of ``args`` with uninitialised ``dtype`` weights on ``device``."""
    with torch.device("meta"):
        net = Transformer(args)
    net = net.to(dtype=dtype).to_empty(device=device)
    net.tie_weights()
    return net


def _read_hf_config(directory: Path, name: str) -> tuple[ModelArgs, Tokenizer]:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no config.json in {directory}")
    args = ModelArgs.from_hf_config(json.loads(config_path.read_text()), name=name)
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        eos = json.loads(generation_path.read_text()).get("eos_token_id")
        extra = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        args.eos_token_ids = tuple(dict.fromkeys(args.eos_token_ids + extra))
    return args, HFTokenizer(directory, eos_token_ids=args.eos_token_ids)


# Our parameter names -> Hugging Face's, for the parts inside and outside decoder layers.
_LAYER_NAMES = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_TOP_PARAM = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(name: str) -> str:
    """The Hugging Face checkpoint name of our parameter ``name``."""
    if m := _LAYER_PARAM.fullmatch(name):
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    if m := _TOP_PARAM.fullmatch(name):
        return f"{_TOP_NAMES[m[1]]}.{m[2]}"
    raise KeyError(name)


def _is_ignored(hf_key: str, args: ModelArgs) -> bool:
    """Checkpoint tensors that carry no weights of ours."""
    if hf_key.endswith("rotary_emb.inv_freq"):
        return True
    return args.tie_word_embeddings and hf_key == "lm_head.weight"


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    return files


def load_safetensors(model: Transformer, directory: Path) -> None:
    """Copies every weight of ``model`` from the safetensors files of ``directory``.

    Raises ValueError naming missing, unexpected or mis-shaped tensors before copying anything.
    """
    from safetensors import safe_open

    params = {hf_name(name): p for name, p in model.named_parameters()}
    files = _safetensors_files(directory)
    keys_by_file: dict[Path, list[str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names = f.keys()
            keys = [k for k in names if not _is_ignored(k, model.args)]
            keys_by_file[path] = keys
            for key in keys:
                if key in params and tuple(f.get_slice(key).get_shape()) != params[key].shape:
                    raise ValueError(
                        f"tensor {key} in {path.name} has shape "
                        f"{tuple(f.get_slice(key).get_shape())}, expected "
                        f"{tuple(params[key].shape)}"
                    )
    found = {k for keys in keys_by_file.values() for k in keys}
    missing = sorted(params.keys() - found)
    unexpected = sorted(found - params.keys())
    if missing or unexpected:
        problems = []
        if missing:
            problems.append("missing tensors: " + ", ".join(missing))
        if unexpected:
            problems.append("unexpected tensors: " + ", ".join(unexpected))
        raise ValueError(f"checkpoint {directory} does not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for path, keys in keys_by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for key in keys:
                    params[key].copy_(f.get_tensor(key))
