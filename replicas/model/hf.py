"""Loads models from local Hugging Face directories: ``config.json`` (and
``generation_config.json``) become ``ModelArgs``, the safetensors files the weights.

The keys every registered architecture shares are read here; what an architecture implies
beyond them (Qwen2's biases, Qwen3's q/k norms, Qwen's sliding windows) is applied by its
registry entry's ``hf_args``.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from replicas.model.config import ModelArgs
from replicas.model.registry import Architecture, architectures, build_model, get_architecture
from replicas.model.tensor_names import check_tensor_names
from replicas.model.tokenizer import HFTokenizer
from replicas.model.transformer import Transformer


def hf_architecture(config: Mapping[str, Any]) -> Architecture:
    """The registered architecture of ``config``: its first ``architectures`` entry, else its
    ``model_type``. Raises ValueError naming it and the supported ones."""
    names = config.get("architectures") or []
    if names:
        return get_architecture(names[0])
    model_type = config.get("model_type")
    by_type = {a.hf_model_type: a for a in architectures() if a.hf_model_type}
    if model_type not in by_type:
        raise ValueError(
            f"config.json names no architectures and an unsupported model_type "
            f"'{model_type}'; Strata supports: " + ", ".join(sorted(by_type))
        )
    return by_type[model_type]


def hf_model_args(config: Mapping[str, Any], name: str = "") -> ModelArgs:
    """Reads a Hugging Face ``config.json`` of a registered architecture.

    Accepts both the ``rope_scaling`` + ``rope_theta`` layout of transformers 4 and the
    ``rope_parameters`` layout of transformers 5.
    """
    architecture = hf_architecture(config)
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act '{config['hidden_act']}'; Strata supports: silu")
    if config.get("mlp_bias", False):
        raise ValueError("unsupported mlp_bias=true")
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads

    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}

    args = ModelArgs(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", False),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_token_ids(config.get("eos_token_id")),
        name=name or config.get("_name_or_path") or architecture.name,
        architecture=architecture.name,
    )
    return architecture.hf_args(args, config)


def read_hf_info(directory: Path, name: str) -> tuple[ModelArgs, HFTokenizer]:
    """The ``ModelArgs`` and tokenizer of a Hugging Face directory; the end-of-sequence ids of
    ``generation_config.json`` join those of ``config.json``."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no config.json in {directory}")
    args = hf_model_args(json.loads(config_path.read_text()), name=name)
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        extra = _token_ids(json.loads(generation_path.read_text()).get("eos_token_id"))
        args.eos_token_ids = tuple(dict.fromkeys(args.eos_token_ids + extra))
    return args, HFTokenizer(directory, eos_token_ids=args.eos_token_ids)


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A config's token id field, which holds one id, a list of them or nothing."""
    return () if value is None else tuple(value) if isinstance(value, list) else (value,)


def _is_ignored(key: str, tied_head: str | None) -> bool:
    """Checkpoint tensors that carry no weights of ours."""
    return key.endswith("rotary_emb.inv_freq") or key == tied_head


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
    weights = SafetensorsWeights(directory, model.args)
    for name, param in model.named_parameters():
        weights.copy_into(name, param)


class SafetensorsWeights:
    """The weights of a Hugging Face directory's safetensors files for a model of ``args``, by
    our parameter names, read one tensor at a time (``replicas.model.streamed``); checked
    against the model (names and shapes) before anything is read."""

    is_quantized = False

    def __init__(self, directory: Path, args: ModelArgs) -> None:
        with torch.device("meta"):
            model = build_model(args)
        self._where = _checked_keys(model, directory)
        self.stored_bits: dict[str, int] = {}  # a float checkpoint: nothing stored quantized
        self.files = sorted(str(p) for p in Path(directory).glob("*") if p.is_file())

    def copy_into(self, name: str, target: torch.Tensor) -> None:
        from safetensors import safe_open

        path, key = self._where[name]
        with safe_open(str(path), framework="pt") as f, torch.no_grad():
            target.copy_(f.get_tensor(key))

    def int4_groups(self, name: str) -> None:
        return None


def _checked_keys(model: Transformer, directory: Path) -> dict[str, tuple[Path, str]]:
    """(file, tensor key) of each of ``model``'s parameters, by parameter name."""
    from safetensors import safe_open

    names = get_architecture(model.args.architecture).hf_tensor_names
    params = {names.tensor_name(name): p for name, p in model.named_parameters()}
    # A tied head shares the embedding's parameter; the checkpoint may still hold a copy.
    tied_head = names.tensor_name("output.weight") if model.args.tie_word_embeddings else None
    where = {}
    for path in _safetensors_files(directory):
        with safe_open(str(path), framework="pt") as f:
            names_in_file = f.keys()  # safe_open objects are not iterable
            for key in names_in_file:
                if _is_ignored(key, tied_head):
                    continue
                where[key] = path
                if key in params and tuple(f.get_slice(key).get_shape()) != params[key].shape:
                    raise ValueError(
                        f"tensor {key} in {path.name} has shape "
                        f"{tuple(f.get_slice(key).get_shape())}, expected "
                        f"{tuple(params[key].shape)}"
                    )
    check_tensor_names(params, list(where), f"checkpoint {directory}")
    ours = {names.tensor_name(name): name for name, _ in model.named_parameters()}
    return {ours[key]: (path, key) for key, path in where.items()}
