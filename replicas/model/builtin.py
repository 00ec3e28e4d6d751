"""Built-in models: small transformers with seeded random weights and the byte tokenizer.

They need no files, so every test and demo runs offline. The weights are drawn on the CPU from
a ``torch.Generator`` seeded by the caller, so one seed gives the same model on every machine.
Embeddings and LM head are scaled so that logits are peaked (top-1 leads top-2 by several units
on most tokens): greedy outputs then agree between batched, chunked and cached computations
despite float rounding.
"""

import math
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

import torch

from replicas.model.config import ModelArgs
from replicas.model.registry import build_model
from replicas.model.tokenizer import ByteTokenizer
from replicas.model.transformer import Transformer


def _tiny() -> ModelArgs:
    return ModelArgs(
        vocab_size=ByteTokenizer().vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        max_position_embeddings=16384,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=(ByteTokenizer.EOS,),
        name="tiny",
    )


def _tiny_hybrid() -> ModelArgs:
    return replace(
        _tiny(),
        num_layers=6,
        layer_types=("sliding", "sliding", "full") * 2,
        sliding_window=64,
        name="tiny-hybrid",
    )


BUILTIN_MODEL_ARGS: MappingProxyType[str, Callable[[], ModelArgs]] = MappingProxyType(
    {"tiny": _tiny, "tiny-hybrid": _tiny_hybrid}
)
BUILTIN_MODELS: tuple[str, ...] = tuple(BUILTIN_MODEL_ARGS)

EMBEDDING_STD = 1.0
LM_HEAD_GAIN = 12.0  # logits std before the final norm's scale; sets how peaked logits are
RESIDUAL_GAIN = 0.5  # scale of the residual branches' output projections


def init_random_weights(model: Transformer, seed: int) -> None:
    """Fills ``model`` (float32, on the CPU) with weights drawn from ``seed``."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    args = model.args
    with torch.no_grad():
        for name, param in model.named_parameters():
            fan_in = param.shape[-1]
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith(".bias"):
                std = 0.02
            elif name == "tok_embeddings.weight":
                std = EMBEDDING_STD
            elif name == "output.weight":
                std = LM_HEAD_GAIN / math.sqrt(fan_in)
            elif name.endswith(("wo.weight", "w2.weight")):
                std = RESIDUAL_GAIN / math.sqrt(fan_in * args.num_layers)
            else:
                std = 1.0 / math.sqrt(fan_in)
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_builtin_model(name: str, seed: int) -> Transformer:
    """The built-in model ``name`` with weights drawn from ``seed``, float32 on the CPU."""
    model = build_model(BUILTIN_MODEL_ARGS[name]())
    init_random_weights(model, seed)
    return model
