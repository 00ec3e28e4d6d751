"""One product over weights of different layouts: a fused q/k/v whose weights a GGUF file
stores in different types (``Q4_K_M``: ``Q4_K`` query and key beside a ``Q6_K`` value in half
the layers; ``Q2_K``: ``Q2_K`` beside ``Q3_K``), each kept in its own layout of Strata's
products rather than all at int8.

The activations are quantized once and one parallel loop takes every weight's tiles
(``strata_native::mixed_mm``, ``replicas/model/quantized_mm.cpp``): the same work per token as
one fused product, with each weight's bytes as stored. Each output row is bitwise what the
weights' own ``QuantizedLinear`` products give (their activations are quantized per row the
same way), so splitting a product by layout changes no output against running its parts apart.
"""

from collections.abc import Sequence

import torch
from torch import nn

from replicas.model.quant import COMPUTE_DTYPE, QuantizedLinear


class MixedLinear(nn.Module):
    """``y = x W^T + b`` for ``W`` the rows of ``parts`` one after the other, each part a
    ``QuantizedLinear`` of Strata's kernels with one ``passes``; every part but the last has a
    multiple of 16 rows (``fits``)."""

    def __init__(self, parts: Sequence[QuantizedLinear]) -> None:
        super().__init__()
        if not self.fits(parts):
            raise ValueError("a mixed product takes Strata's products of one width and passes")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.passes = parts[0].passes
        biases = [p.bias for p in parts]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        for p in parts:
            p.bias = None
        self.register_buffer("bias", bias)

    @staticmethod
    def fits(parts: Sequence[QuantizedLinear]) -> bool:
        """Whether ``parts`` can be one mixed product: Strata's products, one input width and
        one ``passes``, every part but the last a multiple of 16 rows (the kernels' tiles), and
        all with a bias or none."""
        return (
            len(parts) > 1
            and all(p.kernel == "strata" for p in parts)
            and len({(p.in_features, p.passes) for p in parts}) == 1
            and all(p.out_features % 16 == 0 for p in parts[:-1])
            and len({p.bias is None for p in parts}) == 1
        )

    def dequantized(self, dtype: torch.dtype = COMPUTE_DTYPE) -> torch.Tensor:
        """The weight [N, K] as the kernels see it, in ``dtype``."""
        return torch.cat([p.dequantized(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError(
                f"MixedLinear runs on CPUs only, got a {x.device.type} input; load the model "
                "with quantization none on this device"
            )
        shape = x.shape
        y = torch.ops.strata_native.mixed_mm(
            x.reshape(-1, self.in_features),
            [p.weight for p in self.parts],
            [p.scales for p in self.parts],
            [p.scheme == "int4" for p in self.parts],
            [p.out_features for p in self.parts],
            self.passes,
        )
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"passes={self.passes}"
        )
