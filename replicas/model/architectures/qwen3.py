"""Qwen3 (dense): Qwen2's layout with an RMSNorm on each head of q and k before rope, and
biases on q, k and v only when the config says so."""

from dataclasses import replace

from replicas.model.architectures.qwen2 import qwen_sliding_layers
from replicas.model.registry import Architecture, register_architecture

register_architecture(
    Architecture(
        name="Qwen3ForCausalLM",
        hf_model_type="qwen3",
        gguf_name="qwen3",
        hf_args=lambda args, config: replace(qwen_sliding_layers(args, config), qk_norm=True),
        gguf_args=lambda args, metadata: replace(args, qk_norm=True),
    )
)
