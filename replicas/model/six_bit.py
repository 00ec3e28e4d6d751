"""A GGUF ``Q6_K`` weight as its file stores it, in the layout of Strata's 6-bit product
(``replicas/model/quantized_mm6.cpp``, run by ``strata_native::int8_mm`` where the scales are
uint8): ``w = D sc (q - 32)``, ``q`` in [0, 63], an int8 ``sc`` per row and 16 columns, a float16
``D`` per row and 256 columns. 6.5625 bits a weight, the file's own values; the int8 layout the
same weight would otherwise take is 8.5 bits and rounds it again."""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

Q6_K_BLOCK_BYTES = 210
"""A ``Q6_K`` block of 256 weights: ``ql`` (128 bytes), ``qh`` (64), 16 int8 scales, ``d``."""
BLOCK = 256
TILE = 16


class SixBitRows(NamedTuple):
    """A weight the 6-bit layout holds exactly, rows in the model's order: codes [N, K] (uint8
    in [0, 63]), scales [N, K / 16] (int8) and ``D`` [N, K / 256] (float16), ``w = D sc (q -
    32)``: a ``Q6_K`` weight's fields as stored (``from_q6_k``), or a ``Q3_K`` one's
    (``gguf_dequantize.q3_k_six_bit``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    d: torch.Tensor

    @classmethod
    def from_q6_k(cls, rows: torch.Tensor) -> "SixBitRows":
        """``Q6_K`` rows as stored, [N, K / 256 * 210] uint8 (for Strata's 6-bit product, so
        read by its library where it loads)."""
        from replicas.model import native_stack

        if native_stack.load_error() is None:
            return cls(*torch.ops.strata_native.q6_k_fields(rows.contiguous()))
        return cls(*q6_k_fields_torch(rows))

    def rows(self, order: Callable[[torch.Tensor], torch.Tensor]) -> "SixBitRows":
        """The same weight with its rows put in ``order`` (a function of a tensor's rows)."""
        return SixBitRows(*(order(x) for x in self))


def q6_k_fields(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Q6_K`` rows [N, K / 256 * 210] as their codes [N, K] (uint8 in [0, 63], columns in
    order), scales [N, K / 16] (int8) and ``D`` [N, K / 256] (float16): ``q``'s low 4 bits in
    ``ql`` and high 2 in ``qh``, as gguf-py's ``Q6_K`` reads them. One pass of Strata's library
    where this process has loaded it, else torch's ops (``q6_k_fields_torch``)."""
    from replicas.model import native_stack

    if native_stack.is_loaded():
        return torch.ops.strata_native.q6_k_fields(rows.contiguous())
    return q6_k_fields_torch(rows)


def q6_k_fields_torch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q6_k_fields`` in torch's ops."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, Q6_K_BLOCK_BYTES)
    b = blocks.shape[1]
    ql = blocks[..., :128].reshape(n, b, 2, 1, 64)
    ql = torch.cat((ql & 15, ql >> 4), dim=3).reshape(n, b, 256)
    qh = blocks[..., 128:192].reshape(n, b, 2, 1, 32)
    qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(n, b, 256)
    codes = (ql | (qh << 4)).reshape(n, b * BLOCK)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, b * 16)
    d = blocks[..., 208:210].contiguous().view(torch.float16).reshape(n, b)
    return codes, scales, d


def strata_six_bit(parts: Sequence[SixBitRows]) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (fused by rows) in the 6-bit product's layout: codes [N / 16, K / 32 * 6, 64]
    uint8 and scales [N / 16, K / 256, 288] uint8 (``quantized_mm6.cpp``), rows padded with
    zeros to the tiles of 16; packed by Strata's library (``weight_packing.cpp``;
    ``six_bit_weight`` reads them back)."""
    codes, sc, d = (
        x[0].contiguous() if len(parts) == 1 else torch.cat(x) for x in zip(*parts, strict=True)
    )
    return torch.ops.strata_native.pack_six_bit(
        codes.view(torch.uint8), sc.view(torch.int8), d.view(torch.float16)
    )


def six_bit_weight(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weight [N, K] that ``strata_six_bit``'s layout holds."""
    tiles, chunks, _ = packed.shape
    groups = chunks // 6
    k = groups * 32
    c = packed.view(tiles, groups, 6, 16, 4)  # [tile, group, chunk, row, r]
    low = c[:, :, :4].reshape(tiles, groups, 4, 16, 1, 4)
    low = torch.cat((low & 15, low >> 4), dim=4)  # [tile, group, octet, row, nibble, r]
    low = low.permute(0, 3, 1, 2, 4, 5).reshape(tiles * TILE, k)
    high = c[:, :, 4:].reshape(tiles, groups, 2, 16, 1, 4)
    high = torch.cat([(high >> (2 * w)) & 3 for w in range(4)], dim=4)  # [.., which, r]
    high = high.permute(0, 3, 1, 2, 4, 5).reshape(tiles * TILE, k)
    q = (low | (high << 4)).float() - 32
    blocks = k // BLOCK
    d = scales[..., :32].contiguous().view(torch.float16).view(tiles, blocks, TILE)
    sc = scales[..., 32:].contiguous().view(torch.int8).view(tiles, blocks, 16, TILE)
    d = d.permute(0, 2, 1).reshape(tiles * TILE, blocks, 1).float()
    sc = sc.permute(0, 3, 1, 2).reshape(tiles * TILE, blocks, 16, 1).float()
    w = q.view(tiles * TILE, blocks, 16, 16) * sc * d[..., None]
    return w.reshape(tiles * TILE, k)[:n]
