"""GGUF tensor types dequantized to float32 by torch (several threads), bit for bit the values
of gguf-py's numpy dequantization (its order of operations, each rounded to float32 as numpy
rounds it), which remains the path for a type without a torch function here.

Each function takes a type's blocks as stored, [B, bytes per block] uint8, and returns their
weights [B, weights per block] float32. ``dequantize`` is what the loader calls on a slice of a
tensor's rows."""

from typing import Any

import numpy as np
import torch

from replicas.model.six_bit import SixBitRows, q6_k_fields


def dequantize(tensor: Any, data: np.ndarray) -> np.ndarray:
    """``data``, rows of a GGUF ``tensor`` as stored, as float32 values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as numpy_dequantize

    if tensor.tensor_type == GGMLQuantizationType.F32:
        return np.array(data, dtype=np.float32)  # a copy: the file is mapped read-only
    fast = TORCH_DEQUANTIZE.get(tensor.tensor_type.name)
    if fast is not None and data.ndim == 2:
        raw = np.ascontiguousarray(data).view(np.uint8)  # F16 and BF16 rows come typed
        blocks = torch.from_numpy(raw).view(-1, BLOCK_BYTES[fast])
        return fast(blocks).view(data.shape[0], -1).numpy()
    return numpy_dequantize(np.asarray(data), tensor.tensor_type)


def f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block [B, bytes], as float32 [B, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""The sixteen int8 levels of ``IQ4_NL`` and ``IQ4_XS`` codes (llama.cpp's ``kvalues_iq4nl``)."""


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """Bytes [B, 16] of a 32-weight block as its codes [B, 32]: weight ``j < 16`` the low
    nibble of byte ``j``, weight ``j + 16`` its high nibble."""
    return torch.cat((q & 15, q >> 4), dim=1)


def iq4_nl_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``IQ4_NL`` blocks [B, 18] as their level indices [B, 32] (uint8) and ``d`` [B, 1]
    (float32, from float16 at byte 0)."""
    return nibbles(blocks[:, 2:]), f16(blocks, 0)


def iq4_xs_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``IQ4_XS`` blocks [B, 136] as their level indices [B, 256] (uint8; 16 bytes of nibbles
    per 32 weights from byte 8) and the scale of each 32, ``d (ls - 32)`` [B, 8] (float32; the
    6-bit ``ls`` from a nibble of bytes 4-7 and two bits of the uint16 at byte 2)."""
    n = blocks.shape[0]
    low = torch.stack((blocks[:, 4:8] & 15, blocks[:, 4:8] >> 4), dim=2).view(n, 8)
    high = blocks[:, 2:4].contiguous().view(torch.int16).int()  # [B, 1]
    high = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # [B, 8]
    ls = ((low.int() | (high << 4)) - 32).float()
    indices = nibbles(blocks[:, 8:].reshape(n * 8, 16)).view(n, 256)
    return indices, f16(blocks, 0) * ls


def _float16(blocks: torch.Tensor) -> torch.Tensor:
    """``F16`` values, two bytes each, as float32 (exact)."""
    return blocks.view(torch.float16).float()


def _bfloat16(blocks: torch.Tensor) -> torch.Tensor:
    """``BF16`` values, two bytes each, as float32 (exact)."""
    return blocks.view(torch.bfloat16).float()


def fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Four bytes [B, 4] (a little-endian uint32) as bit ``j`` of weight ``j`` [B, 32],
    shifted to bit 4."""
    bits = qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)  # [B, byte, bit]
    return ((bits & 1) << 4).view(-1, 32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """``Q4_0`` blocks [B, 18] as float32 [B, 32]: ``d * (q - 8)`` (gguf-py's order of ops)."""
    codes = nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return codes.float().mul_(f16(blocks, 0))  # d * q, in place (the product commutes)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """``Q4_1`` blocks [B, 20] as float32 [B, 32]: ``d * q + m``."""
    return nibbles(blocks[:, 4:]).float().mul_(f16(blocks, 0)).add_(f16(blocks, 2))


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """``Q5_0`` blocks [B, 22] as float32 [B, 32]: ``d * (q - 16)``, q's fifth bits in bytes
    2-5."""
    codes = (nibbles(blocks[:, 6:]) | fifth_bits(blocks[:, 2:6])).to(torch.int8) - 16
    return codes.float().mul_(f16(blocks, 0))


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """``Q5_1`` blocks [B, 24] as float32 [B, 32]: ``d * q + m``, q's fifth bits in bytes 4-7."""
    codes = nibbles(blocks[:, 8:]) | fifth_bits(blocks[:, 4:8])
    return codes.float().mul_(f16(blocks, 0)).add_(f16(blocks, 2))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """``Q8_0`` blocks [B, 34] as float32 [B, 32]: ``d * q``."""
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(f16(blocks, 0))


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """``IQ4_NL`` blocks [B, 18] as float32 [B, 32]: ``d * IQ4_VALUES[q]`` (``iq4_nl_fields``;
    one pass of Strata's library where this process has loaded it)."""
    if _native():
        return torch.ops.strata_native.iq4_values(blocks.contiguous(), False)
    indices, d = iq4_nl_fields(blocks)
    levels = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    return levels[indices.long()].mul_(d)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """``IQ4_XS`` blocks [B, 136] as float32 [B, 256]: ``(d (ls - 32)) IQ4_VALUES[q]`` per 32
    weights (``iq4_xs_fields``; one pass of Strata's library where this process has loaded it)."""
    if _native():
        return torch.ops.strata_native.iq4_values(blocks.contiguous(), True)
    n = blocks.shape[0]
    indices, scales = iq4_xs_fields(blocks)
    levels = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    return levels[indices.long()].view(n, 8, 32).mul_(scales.view(n, 8, 1)).view(n, 256)


def _native() -> bool:
    """Whether Strata's library is loaded in this process (its passes are then used)."""
    from replicas.model import native_stack

    return native_stack.is_loaded()


def two_bit_codes(q: torch.Tensor) -> torch.Tensor:
    """Bytes [B, 64] of 2-bit codes (``Q2_K``'s, ``Q3_K``'s low bits) as the codes [B, 256]:
    per 128 weights 32 bytes, weight ``32 s + l`` in bits ``2 s`` of byte ``l``."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    return ((q[:, None].reshape(-1, 2, 1, 32) >> shifts) & 3).view(-1, 256)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """``Q2_K`` blocks [B, 84] as float32 [B, 256]: ``(d sc) q - dmin m`` per 16 weights, the
    4-bit ``sc`` and ``m`` in bytes 0-15 (low and high nibble), q's 2 bits in bytes 16-79 (four
    per byte, 32 bytes per 128 weights), d and dmin at 80 and 82. One pass of Strata's library
    where this process has loaded it, else torch's ops (``q2_k_torch``)."""
    if _native():
        return torch.ops.strata_native.q2_k_values(blocks.contiguous())
    return q2_k_torch(blocks)


def q2_k_torch(blocks: torch.Tensor) -> torch.Tensor:
    """``_q2_k`` in torch's ops."""
    n = blocks.shape[0]
    sc, m = (blocks[:, :16] & 15).float(), (blocks[:, :16] >> 4).float()
    dl, ml = (f16(blocks, 80) * sc).view(n, 16, 1), (f16(blocks, 82) * m).view(n, 16, 1)
    q = two_bit_codes(blocks[:, 16:80]).view(n, 16, 16)
    return q.float().mul_(dl).sub_(ml).view(n, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """``Q3_K`` blocks [B, 110] as float32 [B, 256]: ``(d (sc - 32)) q`` per 16 weights
    (``q3_k_fields``; gguf-py's order of ops)."""
    n = blocks.shape[0]
    q, scales, d = q3_k_fields(blocks)
    return q.float().view(n, 16, 16).mul_((d.float() * scales.float()).view(n, 16, 1)).view(n, 256)


def q3_k_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Q3_K`` blocks [B, 110] as their codes [B, 256] (int8 in [-4, 3]: 2 low bits in ``qs``,
    bytes 32-95, and a high bit in ``hmask``, bytes 0-31, clear: 4 less), scales [B, 16] (int8
    ``sc - 32``, 6 bits from the low nibbles of bytes 96-103 and 2 high bits in 104-107) and
    ``d`` [B, 1] (float16, at 108). One pass of Strata's library where this process has
    loaded it, else torch's ops (``q3_k_fields_torch``)."""
    if _native():
        return torch.ops.strata_native.q3_k_fields(blocks.contiguous())
    return q3_k_fields_torch(blocks)


def q3_k_fields_torch(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q3_k_fields`` in torch's ops."""
    n = blocks.shape[0]
    low, high = blocks[:, 96:104], blocks[:, 104:108]
    low_bits = torch.stack((low & 15, low >> 4), dim=1).view(n, 16)
    high_bits = torch.stack([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=1).view(n, 16)
    scales = (low_bits | (high_bits << 4)).view(torch.int8) - 32
    ql = two_bit_codes(blocks[:, 32:96])
    qh = ((blocks[:, None, :32] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) ^ 1
    q = ql.view(torch.int8) - (qh.view(n, 256) << 2).view(torch.int8)
    return q, scales, blocks[:, 108:110].contiguous().view(torch.float16)


def q3_k_six_bit(rows: torch.Tensor) -> SixBitRows:
    """``Q3_K`` rows [N, K / 256 * 110] as the 6-bit layout's fields of the same values: each
    code ``q`` as ``q + 32``, the same scales and ``D`` (a ``Q6_K`` block has a signed scale
    per 16 weights too), so that Strata's 6-bit product serves the weight exactly (6.5625 bits
    rather than 3.4375; no int4 layout holds a ``Q3_K`` group of 32, whose two halves have
    scales of their own)."""
    n = rows.shape[0]
    q, scales, d = q3_k_fields(rows.reshape(-1, 110))
    codes = (q + 32).view(torch.uint8).reshape(n, -1)
    return SixBitRows(codes, scales.reshape(n, -1), d.reshape(n, -1))


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """``Q4_K`` blocks [B, 144] as float32 [B, 256]: ``(d sc) q - dmin m`` per 32 weights
    (``_q4_k_scales``)."""
    n = blocks.shape[0]
    d, dm = (x.view(n, 8, 1) for x in _q4_k_scales(blocks))
    return k_quant_codes(blocks, five=False).float().mul_(d).sub_(dm).view(n, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """``Q5_K`` blocks [B, 176] as float32 [B, 256]: ``_q4_k``'s values with a fifth bit per
    code (``k_quant_codes``)."""
    n = blocks.shape[0]
    d, dm = (x.view(n, 8, 1) for x in _q4_k_scales(blocks))
    return k_quant_codes(blocks, five=True).float().mul_(d).sub_(dm).view(n, 256)


def k_quant_codes(blocks: torch.Tensor, five: bool) -> torch.Tensor:
    """The codes [B, 8, 32] (group, weight) of ``Q4_K`` blocks [B, 144], or of ``Q5_K`` blocks
    [B, 176] (``five``: bit ``g`` of ``qh`` byte ``l`` is group ``g``'s weight ``l``'s fifth).
    One pass of Strata's library where this process has loaded it, else torch's ops."""
    if _native():
        return torch.ops.strata_native.k_quant_codes(blocks.contiguous(), five)
    return k_quant_codes_torch(blocks, five)


def k_quant_codes_torch(blocks: torch.Tensor, five: bool) -> torch.Tensor:
    """``k_quant_codes`` in torch's ops."""
    q = blocks[:, 48 if five else 16 :].reshape(-1, 4, 1, 32)
    codes = torch.cat((q & 15, q >> 4), dim=2).view(-1, 8, 32)
    if five:
        qh = blocks[:, None, 16:48] >> torch.arange(8, dtype=torch.uint8)[:, None]
        codes = codes | ((qh & 1) << 4)
    return codes


def _q4_k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``d sc`` and ``dmin m`` [B, 8] float32 of ``Q4_K`` blocks [B, 144]: the eight 6-bit
    scales and mins packed in 12 bytes (gguf-py's ``Q4_K.get_scale_min``)."""
    sc, m = q4_k_codes(blocks)
    return f16(blocks, 0) * sc, f16(blocks, 2) * m


def q4_k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scale and min codes [B, 8] (float32) of ``Q4_K`` blocks [B, 144]."""
    low, high, mixed = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    sc = torch.cat((low & 63, (mixed & 15) | ((low >> 2) & 48)), dim=1).float()
    m = torch.cat((high & 63, (mixed >> 4) | ((high >> 2) & 48)), dim=1).float()
    return sc, m


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """``Q6_K`` blocks [B, 210] as float32 [B, 256]: ``(d scale) (q - 32)`` per 16 weights, q's
    low 4 bits in ``ql`` and high 2 in ``qh``."""
    n = blocks.shape[0]
    q, scales, d = q6_k_fields(blocks)  # a block per row
    codes = (q.to(torch.int8) - 32).view(n, 16, 16).float()
    return codes.mul_((d.float() * scales.float()).view(n, 16, 1)).view(n, 256)


TORCH_DEQUANTIZE = {
    "F16": _float16,
    "BF16": _bfloat16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
"""The types dequantized by torch, by ggml's names."""
BLOCK_BYTES = {_float16: 2, _bfloat16: 2, _q4_0: 18, _q4_1: 20, _q5_0: 22, _q5_1: 24, _q8_0: 34}
BLOCK_BYTES |= {_iq4_nl: 18, _iq4_xs: 136, _q2_k: 84, _q3_k: 110, _q4_k: 144, _q5_k: 176}
BLOCK_BYTES |= {_q6_k: 210}
