"""Model hyper-parameters and the shape of the KV cache they imply."""

from dataclasses import dataclass
from typing import Any

import torch

from replicas.model.kv_format import KVFormat, float_format

SUPPORTED_ROPE_TYPES = ("default", "llama3")
LAYER_TYPES = ("full", "sliding")


@dataclass(slots=True)
class ModelArgs:
    """The hyper-parameters of one model; ``architecture`` names the registry entry that says
    which class to build and how its checkpoints name their tensors."""

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
    architecture: str = "LlamaForCausalLM"  # registered name (replicas.model.registry)

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


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The KV cache of one group of layers sharing an attention type.

    One block holds ``block_size`` tokens of every layer of the group, one row of
    ``kv_format`` per token and KV head (``head_dim`` values, or codes and their scale)::

        cache[block, layer, 0 (k) | 1 (v), offset, kv_head, row_width]

    ``dtype`` is the dtype the model computes in; ``kv_format`` how the cache stores K and V
    (by default as values in ``dtype``).
    """

    group: str  # "full" | "sliding"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    dtype: torch.dtype
    kv_format: KVFormat = None  # type: ignore[assignment]  # None: float_format(dtype)

    def __post_init__(self) -> None:
        if self.kv_format is None:
            object.__setattr__(self, "kv_format", float_format(self.dtype))

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype."""
        return self.kv_format.storage_dtype

    @property
    def row_width(self) -> int:
        """Elements of ``storage_dtype`` per token, layer, k|v and KV head."""
        return self.kv_format.row_width(self.head_dim)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block, scales included."""
        row_bytes = self.kv_format.row_bytes(self.head_dim)
        return self.num_layers * 2 * block_size * self.num_kv_heads * row_bytes

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, block_size, self.num_kv_heads, self.row_width)
