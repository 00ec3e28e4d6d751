"""How K and V are stored in the block KV cache (``kv_cache_dtype``), in every tier alike.

The cache is a tensor of rows, one per (block, layer, k|v, offset, kv head). A format says what
one row holds and how a ``[n, head_dim]`` K or V becomes rows and back:

- a float format (float32, bfloat16, float16): ``head_dim`` values in that dtype; quantizing
  is a cast;
- a scaled 8-bit format (int8, fp8_e4m3): ``head_dim`` one-byte codes followed by one float16
  scale, ``head_dim + 2`` bytes in a uint8 row::

      | code 0 | code 1 | ... | code head_dim-1 | scale (float16, 2 bytes) |

  ``value = code * scale``, with ``scale = amax / max_code`` of the row, rounded up to float16
  so that no code saturates (0 for a row of zeros).

One scale per token and KV head: a token's K/V is written once, when it is computed (one token
a step in decode), and never rewritten; a scale shared by the tokens of a block or by a channel
would have to be known before the block's later tokens exist, or the block requantized as it
fills. The float16 scale costs 2 bytes a row: with ``head_dim`` 64 an int8 block is
``66 / 128`` of a bfloat16 one. docs/design.md states the measured accuracy.

The tiers move a block's bytes as they are (a uint8 cache is copied and stored like any
other); only attention (``replicas.model.attention``) quantizes, on write, and dequantizes, the
rows of the chunk it reads.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from replicas.dtypes import TORCH_DTYPES

SCALE_BYTES = 2  # one float16 scale per row of a scaled format


@dataclass(frozen=True, slots=True)
class KVFormat(ABC):
    """One way of storing rows of K or V; ``storage_dtype`` is the cache tensor's dtype."""

    name: str
    storage_dtype: torch.dtype

    @property
    def is_quantized(self) -> bool:
        """True when a row holds codes and a scale rather than the values themselves."""
        return False

    @abstractmethod
    def row_width(self, head_dim: int) -> int:
        """Elements of ``storage_dtype`` in one row of ``head_dim`` values."""

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.storage_dtype.itemsize

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, head_dim] floats -> rows [n, row_width] of ``storage_dtype``."""

    @abstractmethod
    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows [..., row_width] -> values [..., head_dim] in ``dtype``."""

    @abstractmethod
    def split(
        self, rows: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """rows [..., row_width] -> (codes [..., head_dim], scales [..., 1] or None), both in
        ``dtype``, with values ``codes * scales`` (``codes`` alone without scales): attention
        folds a row's scale into its scores or probabilities instead of into its values."""


@dataclass(frozen=True, slots=True)
class FloatKVFormat(KVFormat):
    """Rows of ``head_dim`` values in ``storage_dtype``."""

    def row_width(self, head_dim: int) -> int:
        return head_dim

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.storage_dtype)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows.to(dtype)

    def split(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, None]:
        return rows.to(dtype), None


@dataclass(frozen=True, slots=True)
class ScaledKVFormat(KVFormat):
    """Rows of ``head_dim`` one-byte codes of ``code_dtype`` and one float16 scale (uint8)."""

    code_dtype: torch.dtype = torch.int8
    max_code: float = 127.0

    @property
    def is_quantized(self) -> bool:
        return True

    def row_width(self, head_dim: int) -> int:
        return head_dim + SCALE_BYTES

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        scale = _scale_up(x.abs().amax(-1, keepdim=True) / self.max_code)  # [n, 1] float16
        scaled = x / torch.where(scale == 0, 1.0, scale.float())  # within +-max_code
        if self.code_dtype == torch.int8:
            codes = scaled.round_().clamp_(-self.max_code, self.max_code).to(torch.int8)
        else:
            codes = scaled.clamp_(-self.max_code, self.max_code).to(self.code_dtype)
        return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # code * scale is exact in float32 (at most 8 + 11 significant bits), so a narrower
        # dtype gets it rounded once, and a CPU multiplies float32 faster than bfloat16.
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        codes, scales = self.split(rows, wide)
        return codes.mul_(scales).to(dtype)

    def split(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = rows.shape[-1] - SCALE_BYTES
        codes = rows[..., :head_dim].view(torch.int8)
        scales = rows[..., head_dim:].view(torch.float16).to(dtype, copy=True)  # [..., 1]
        if self.code_dtype == torch.int8:
            return codes.to(dtype), scales
        # float16 -> float32 -> dtype: a CPU has no fast float16 -> bfloat16 conversion
        values = _fp8_e4m3_as_float16(codes).float().to(dtype)
        return values, scales.mul_(FP8_E4M3_IN_FLOAT16)


def _scale_up(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales -> the nearest float16 at or above each (capped at float16's largest),
    so that ``|x| / scale <= max_code``: no code saturates."""
    capped = scale.clamp(max=torch.finfo(torch.float16).max)
    rounded = capped.to(torch.float16)
    below = rounded.float() < capped  # positive float16s: the next one up is bits + 1
    return torch.where(below, (rounded.view(torch.int16) + 1).view(torch.float16), rounded)


FP8_E4M3_IN_FLOAT16 = 2.0**8  # an e4m3 code's bits read as float16 are its value / 2^8
_FP8_IN_FLOAT16_BITS = -0x4080  # 0xBF80 as int16: float16's sign, exponent bits 3..0, mantissa 9..7


def _fp8_e4m3_as_float16(codes: torch.Tensor) -> torch.Tensor:
    """int8 views of float8_e4m3fn codes -> float16 values ``code / 2^8``, exactly.

    e4m3's sign, 4 exponent and 3 mantissa bits, placed at float16's sign bit and the low 4 of
    its 5 exponent bits and top 3 mantissa bits, read as a float16 whose exponent bias (15) is
    8 above e4m3's (7): every normal and subnormal code (all but NaN, which no row holds) is
    ``2^8`` times that float16. A few integer ops, several times faster on a CPU without fp8
    instructions than torch's float8 cast.
    """
    bits = codes.to(torch.int16)  # sign-extended: bits 15..7 the sign, 6..3 exponent, 2..0 mantissa
    return bits.bitwise_left_shift_(7).bitwise_and_(_FP8_IN_FLOAT16_BITS).view(torch.float16)


KV_FORMATS: dict[str, KVFormat] = {
    **{name: FloatKVFormat(name, dtype) for name, dtype in TORCH_DTYPES.items()},
    "fp8_e4m3": ScaledKVFormat("fp8_e4m3", torch.uint8, torch.float8_e4m3fn, 448.0),
    "int8": ScaledKVFormat("int8", torch.uint8, torch.int8, 127.0),
}
"""Every ``kv_cache_dtype`` but ``auto``, by name."""


def kv_format(name: str, dtype: torch.dtype) -> KVFormat:
    """The format of ``kv_cache_dtype`` ``name`` for an engine computing in ``dtype`` (``auto``:
    ``dtype`` itself); ``ValueError`` naming the choices otherwise."""
    if name == "auto":
        return float_format(dtype)
    if name not in KV_FORMATS:
        choices = ", ".join(["auto", *KV_FORMATS])
        raise ValueError(f"kv_cache_dtype must be one of {choices}, got {name!r}")
    return KV_FORMATS[name]


def float_format(dtype: torch.dtype) -> KVFormat:
    """The float format storing values in ``dtype``: what a float cache tensor holds."""
    for candidate in KV_FORMATS.values():
        if not candidate.is_quantized and candidate.storage_dtype == dtype:
            return candidate
    raise ValueError(f"no float KV format stores {dtype}; a {dtype} cache needs its KV format")
