"""Qwen2 and Qwen2.5: Llama's layout with biases on the q, k and v projections, and
sliding-window attention on the upper layers when the config turns it on."""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from replicas.model.config import ModelArgs
from replicas.model.registry import Architecture, register_architecture


def qwen_sliding_layers(args: ModelArgs, config: Mapping[str, Any]) -> ModelArgs:
    """``args`` with the sliding-window layers of a Qwen ``config.json``: none unless
    ``use_sliding_window``; then the layers ``layer_types`` names, else those from
    ``max_window_layers`` on."""
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    if not window:
        return args
    hf_types = config.get("layer_types") or [
        "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
        for i in range(args.num_layers)
    ]
    layer_types = tuple("sliding" if t == "sliding_attention" else "full" for t in hf_types)
    if "sliding" not in layer_types:
        return args
    return replace(args, layer_types=layer_types, sliding_window=window)


register_architecture(
    Architecture(
        name="Qwen2ForCausalLM",
        hf_model_type="qwen2",
        gguf_name="qwen2",
        hf_args=lambda args, config: replace(
            qwen_sliding_layers(args, config), attention_bias=True
        ),
        gguf_args=lambda args, metadata: replace(args, attention_bias=True),
    )
)
