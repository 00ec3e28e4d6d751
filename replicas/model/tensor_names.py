"""How the Transformer's parameter names map to the tensor names of a checkpoint format.

Our names come in two shapes: ``layers.{i}.{part}.{kind}`` inside decoder layer ``i`` and
``{part}.{kind}`` outside them, ``kind`` being ``weight`` or ``bias``. A ``TensorNames`` maps
each ``part`` to the format's name; an architecture whose checkpoints name tensors differently
registers its own maps (see ``replicas.model.registry``).
"""

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_TOP_PARAM = re.compile(r"(\w+)\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class TensorNames:
    """``layers.{i}.{part}.{kind}`` is ``{layer_prefix}{i}.{layers[part]}.{kind}`` in the
    checkpoint, and ``{part}.{kind}`` is ``{top[part]}.{kind}``."""

    layer_prefix: str
    layers: Mapping[str, str]
    top: Mapping[str, str]

    def tensor_name(self, name: str) -> str:
        """The checkpoint's name of our parameter ``name``; KeyError if it has none."""
        if m := _LAYER_PARAM.fullmatch(name):
            return f"{self.layer_prefix}{m[1]}.{self.layers[m[2]]}.{m[3]}"
        if m := _TOP_PARAM.fullmatch(name):
            return f"{self.top[m[1]]}.{m[2]}"
        raise KeyError(name)


# Each part of the Transformer -> its name in Hugging Face checkpoints of the Llama family and
# in llama.cpp's GGUF files, inside decoder layers and outside them.
_LAYER_PARTS = {
    "attention_norm": ("input_layernorm", "attn_norm"),
    "ffn_norm": ("post_attention_layernorm", "ffn_norm"),
    "attention.wq": ("self_attn.q_proj", "attn_q"),
    "attention.wk": ("self_attn.k_proj", "attn_k"),
    "attention.wv": ("self_attn.v_proj", "attn_v"),
    "attention.wo": ("self_attn.o_proj", "attn_output"),
    "attention.q_norm": ("self_attn.q_norm", "attn_q_norm"),
    "attention.k_norm": ("self_attn.k_norm", "attn_k_norm"),
    "feed_forward.w1": ("mlp.gate_proj", "ffn_gate"),
    "feed_forward.w3": ("mlp.up_proj", "ffn_up"),
    "feed_forward.w2": ("mlp.down_proj", "ffn_down"),
}
_TOP_PARTS = {
    "tok_embeddings": ("model.embed_tokens", "token_embd"),
    "norm": ("model.norm", "output_norm"),
    "output": ("lm_head", "output"),
}


def _column(parts: dict[str, tuple[str, str]], i: int) -> Mapping[str, str]:
    return MappingProxyType({ours: names[i] for ours, names in parts.items()})


HF_TENSOR_NAMES = TensorNames("model.layers.", _column(_LAYER_PARTS, 0), _column(_TOP_PARTS, 0))
GGUF_TENSOR_NAMES = TensorNames("blk.", _column(_LAYER_PARTS, 1), _column(_TOP_PARTS, 1))


def check_tensor_names(expected: Collection[str], found: Collection[str], source: str) -> None:
    """Raises ValueError naming the tensors ``source`` lacks and those it has that ``expected``
    does not list."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if not (missing or unexpected):
        return
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(unexpected))
    raise ValueError(f"{source} does not fit the model: " + "; ".join(problems))
