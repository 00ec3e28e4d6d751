"""Products that share an input, fused into one: Q, K and V, and the gate and up projections.

On a GPU a decode step's products are bandwidth-bound launches; one product over the
concatenated weights reads the same bytes in one launch instead of three (or two). The
quantized layouts fuse their own (``replicas.model.quant``); this fuses float ``nn.Linear``s.
The fused modules take the places ``Attention.wqkv`` and ``FeedForward.w13`` keep for them, and
the originals are dropped, so the weights are held once.
"""

import torch
from torch import nn

from replicas.model.transformer import Transformer


def fuse_projections(model: Transformer) -> int:
    """Fuses every layer's float Q/K/V and gate/up products; returns how many were fused."""
    fused = 0
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        parts = (attention.wq, attention.wk, attention.wv)
        if attention.wqkv is None and all(type(p) is nn.Linear for p in parts):
            attention.wqkv = _concatenated(parts)
            attention.wq = attention.wk = attention.wv = None
            fused += 1
        if ffn.w13 is None and type(ffn.w1) is nn.Linear and type(ffn.w3) is nn.Linear:
            ffn.w13 = _concatenated((ffn.w1, ffn.w3))
            ffn.w1 = ffn.w3 = None
            fused += 1
    return fused


@torch.no_grad()
def _concatenated(parts: tuple[nn.Linear, ...]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the outputs of ``parts`` side by side."""
    weight = torch.cat([p.weight for p in parts])
    has_bias = parts[0].bias is not None
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        out.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return out
