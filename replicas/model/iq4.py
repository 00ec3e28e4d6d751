"""GGUF ``IQ4_NL`` and ``IQ4_XS`` weights: 4-bit indices into 16 levels that are not evenly
spaced, under a scale per 32 weights, which no int4 layout holds. Strata's int4 kernel takes
them in int4's layout with each index standing for its level + 128 (``quantized_mm.cpp``), so
an int4 model serves the file's values at 4.5 bits a weight (4 of codes, a float16 ``d`` and
``m = -128 d`` per 32); under torch's kernels they are int8 (``gguf_weights._TYPE_BITS``)."""

import torch

from replicas.model.gguf_dequantize import IQ4_VALUES as IQ4_VALUES
from replicas.model.gguf_dequantize import iq4_nl_fields, iq4_xs_fields
from replicas.model.quant import Int4Groups, _pack_int4_codes


def iq4_groups(kind: str, rows: torch.Tensor) -> Int4Groups:
    """An ``IQ4_NL`` or ``IQ4_XS`` weight's rows as stored [N, bytes] as ``Int4Groups`` with
    ``levels``: the indices [N, K] and the scale of each row's groups of 32 [N, K / 32]."""
    n = rows.shape[0]
    if kind == "IQ4_NL":
        indices, scale = iq4_nl_fields(rows.reshape(-1, 18))
    else:
        indices, scale = iq4_xs_fields(rows.reshape(-1, 136))
    scale = scale.reshape(n, -1)
    return Int4Groups(indices.reshape(n, -1), scale, torch.zeros_like(scale), levels=True)


def strata_levels(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Level indices [N, K] and their ``scale`` [N, K / 32] in the layout of Strata's int4
    kernel, the codes typed int8 (each index stands for its level + 128, and ``m = -128 d``):
    None where its library is not built here or ``m`` overflows float16. A scale in float16's
    subnormal range keeps its value to within 2^-25, far below a level's step."""
    from replicas.model import native_stack

    if native_stack.load_error() is not None:
        return None
    d16 = scale.half()
    m16 = -128 * d16  # exact: a power of two
    if not torch.isfinite(m16).all():
        return None
    n = codes.shape[0]
    tiles = [t.view(n // 16, 16, -1).permute(0, 2, 1) for t in (d16, m16)]  # [tile, group, row]
    packed = _pack_int4_codes(codes).view(torch.int8)
    return packed, torch.stack(tiles, dim=2).contiguous()
