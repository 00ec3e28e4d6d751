"""Built-in models: transformers with seeded random weights and the byte tokenizer.

They need no files, so every test and demo runs offline. The small ones' weights are drawn on
the CPU from a ``torch.Generator`` seeded by the caller, so one seed gives the same model on
every machine. The real-shape ones (``llama3-8b-shape``, ``qwen3-8b-shape``: the vocabulary,
layer count and shapes of Llama-3-8B and Qwen3-8B) exist to measure a GPU at real sizes: their
weights are drawn on the device they load to, in the dtype they load in (bfloat16 for ``auto``),
never staged in float32 on the host.
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


def _llama3_8b_shape() -> ModelArgs:
    return ModelArgs(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=(ByteTokenizer.EOS,),
        name="llama3-8b-shape",
    )


def _qwen3_8b_shape() -> ModelArgs:
    return ModelArgs(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=(ByteTokenizer.EOS,),
        name="qwen3-8b-shape",
        architecture="Qwen3ForCausalLM",
    )


BUILTIN_MODEL_ARGS: MappingProxyType[str, Callable[[], ModelArgs]] = MappingProxyType(
    {
        "tiny": _tiny,
        "tiny-hybrid": _tiny_hybrid,
        "llama3-8b-shape": _llama3_8b_shape,
        "qwen3-8b-shape": _qwen3_8b_shape,
    }
)
REAL_SHAPE_MODELS = frozenset({"llama3-8b-shape", "qwen3-8b-shape"})
BUILTIN_MODELS: tuple[str, ...] = tuple(BUILTIN_MODEL_ARGS)

EMBEDDING_STD = 1.0
LM_HEAD_GAIN = 12.0  # logits std before the final norm's scale; sets how peaked logits are
RESIDUAL_GAIN = 0.5  # scale of the residual branches' output projections


def init_random_weights(model: Transformer, seed: int, on_device: bool = False) -> None:
    """Fills ``model`` with weights drawn from ``seed``: on the CPU in float32 and copied (the
    same values everywhere), or ``on_device``, where the weights are, in their dtype."""
    device = next(model.parameters()).device if on_device else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
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
            dtype = param.dtype if on_device else torch.float32
            param.copy_(
                torch.randn(param.shape, generator=generator, device=device, dtype=dtype) * std
            )


def build_builtin_model(
    name: str, seed: int, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> Transformer:
    """The built-in model ``name`` with weights drawn from ``seed``, on ``device`` in ``dtype``
    (default: float32 on the CPU); a real-shape model's weights are drawn there directly."""
    device = torch.device("cpu") if device is None else device
    dtype = torch.float32 if dtype is None else dtype
    if name not in REAL_SHAPE_MODELS:
        model = build_model(BUILTIN_MODEL_ARGS[name]())
        init_random_weights(model, seed)
        return model.to(device=device, dtype=dtype)
    with torch.device("meta"):
        model = build_model(BUILTIN_MODEL_ARGS[name]())
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    init_random_weights(model, seed, on_device=True)
    return model
