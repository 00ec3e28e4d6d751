"""A GGUF ``Q2_K`` weight as its file stores it, in the layout of Strata's 2-bit product
(``replicas/model/quantized_mm2.cpp``, run by ``strata_native::int4_mm`` where the codes have two
chunks per group of 32 columns): ``w = d sc q - dmin m``, ``q`` in [0, 3], 4-bit ``sc`` and
``m`` per row and 16 columns, float16 ``d`` and ``dmin`` per row and 256 columns. 2.625 bits a
weight, the file's own values; the int8 layout the same weight would otherwise take is 8.5 bits,
and no int4 grouping of 32 holds a scale and a minimum per 16."""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

Q2_K_BLOCK_BYTES = 84
"""A ``Q2_K`` block of 256 weights: 16 bytes of ``sc | m << 4``, 64 of codes, ``d``, ``dmin``."""
BLOCK = 256
TILE = 16


class TwoBitRows(NamedTuple):
    """A ``Q2_K`` weight as stored, rows [N, K / 256 * 84] (uint8) in the model's order."""

    blocks: torch.Tensor

    def rows(self, order: Callable[[torch.Tensor], torch.Tensor]) -> "TwoBitRows":
        """The same weight with its rows put in ``order`` (a function of a tensor's rows)."""
        return TwoBitRows(order(self.blocks))


def strata_two_bit(parts: Sequence[TwoBitRows]) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (fused by rows) in the 2-bit product's layout: codes [N / 16, K / 32 * 2, 64]
    uint8 and scales [N / 16, K / 256, 320] uint8 (``quantized_mm2.cpp``), rows padded with
    zeros to the tiles of 16; packed by Strata's library (``weight_packing.cpp``;
    ``two_bit_weight`` reads them back)."""
    rows = parts[0].blocks if len(parts) == 1 else torch.cat([p.blocks for p in parts])
    return torch.ops.strata_native.pack_two_bit(rows.contiguous())


def two_bit_weight(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weight [N, K] that ``strata_two_bit``'s layout holds, rounded as gguf-py
    rounds ``Q2_K`` (``q (d sc) - dmin m``)."""
    tiles, chunks, _ = packed.shape
    groups = chunks // 2
    k = groups * 32
    c = packed.view(tiles, groups, 2, TILE, 1, 4)  # [tile, group, half, row, 1, r]
    q = torch.cat([(c >> (2 * w)) & 3 for w in range(4)], dim=4)  # [.., row, w, r]
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(tiles * TILE, k).float()
    blocks = k // BLOCK
    s = scales.view(tiles, blocks, 320)
    d, neg_min = (
        s[..., at : at + 32].contiguous().view(torch.float16).float().permute(0, 2, 1)
        for at in (0, 32)
    )  # [tile, row, block]
    runs = s[..., 64:].reshape(tiles, blocks, 16, TILE).permute(0, 3, 1, 2)  # [tile, row, b, s]
    dl = (d[..., None] * (runs & 15).float()).reshape(tiles * TILE, blocks * 16, 1)
    ml = (neg_min[..., None] * (runs >> 4).float()).reshape(tiles * TILE, blocks * 16, 1)
    w = q.view(tiles * TILE, blocks * 16, 16) * dl + ml
    return w.reshape(tiles * TILE, k)[:n]
