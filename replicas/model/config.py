"""Model hyper-parameters and the shape of the KV cache they imply."""

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# A config.json without "architectures" is read by its "model_type".
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
LAYER_TYPES = ("full", "sliding")


@dataclass(slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None or {"rope_type": "llama3", "factor": ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    layer_types: tuple[str, ...] = ()  # "full" | "sliding" per layer; empty means all "full"
    sliding_window: int | None = None  # a sliding layer's query sees itself + window-1 keys back
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ("full",) * self.num_layers
        self.layer_types = tuple(self.layer_types)
        self.eos_token_ids = tuple(self.eos_token_ids)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer types {unknown}; expected one of {LAYER_TYPES}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a positive sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type '{self.rope_type}'; Strata supports: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], name: str = "") -> "ModelArgs":
        """Reads a Hugging Face ``config.json`` of a supported architecture.

        Accepts both the ``rope_scaling`` + ``rope_theta`` layout of transformers 4 and the
        ``rope_parameters`` layout of transformers 5.
        """
        architectures = d.get("architectures") or []
        model_type = d.get("model_type")
        arch = architectures[0] if architectures else ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
        if arch is None:
            raise ValueError(
                f"config.json names no architectures and an unsupported model_type "
                f"'{model_type}'; Strata supports: " + ", ".join(ARCHITECTURE_OF_MODEL_TYPE)
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture '{arch}'; Strata supports: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act '{d['hidden_act']}'; Strata supports: silu")
        if d.get("mlp_bias", False):
            raise ValueError("unsupported mlp_bias=true")
        num_heads = d["num_attention_heads"]
        num_layers = d["num_hidden_layers"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads

        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}

        sliding_window = None
        layer_types: tuple[str, ...] = ("full",) * num_layers
        if arch != "LlamaForCausalLM" and d.get("use_sliding_window", False):
            sliding_window = d.get("sliding_window")
        if sliding_window:
            hf_types = d.get("layer_types") or [
                "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
                for i in range(num_layers)
            ]
            layer_types = tuple("sliding" if t == "sliding_attention" else "full" for t in hf_types)
        if "sliding" not in layer_types:
            sliding_window = None

        eos = d.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or d.get("attention_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            layer_types=layer_types,
            sliding_window=sliding_window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            name=name or d.get("_name_or_path") or arch,
        )


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The KV cache of one group of layers sharing an attention type.

    One block holds ``block_size`` tokens of every layer of the group::

        cache[block, layer, 0 (k) | 1 (v), offset, kv_head, head_dim]
    """

    group: str  # "full" | "sliding"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    dtype: torch.dtype

    def block_bytes(self, block_size: int) -> int:
        itemsize = self.dtype.itemsize
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * itemsize

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)
