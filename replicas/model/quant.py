"""Weight-only quantized linear layers: int8 per output channel, int4 in groups of 32.

A decode step multiplies a few activation rows by every weight of the model, so its time is the
bytes of weights read: int8 reads a quarter of float32's bytes, int4 an eighth. The products use
torch's packed CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``), which take
bfloat16 activations: the layer multiplies in bfloat16 (float32 accumulation inside the kernel)
and returns the caller's dtype. How fast they are against a dense GEMM differs from one CPU to
the next, so ``quantization: auto`` measures them on the machine (``replicas.model.autotune``);
how torch packs the int4 nibbles differs too, so nothing here assumes one packing
(``_unpack_int4`` reads codes back through the kernel itself).

The packed kernels run at every row count, prefill chunks included, although past a few dozen
rows a dense bfloat16 GEMM over the weight dequantized for the call is faster: a packed kernel
computes each row alone, bitwise the same whatever else is in the batch, so the products add
nothing to what chunking, batching and prefix caching change in an output (float32-level
differences elsewhere; ``tests/unit/model/test_quant.py``). A dense GEMM's rounding depends on
its shape, which at bfloat16 precision flips near-tied greedy tokens. The layers run on CPUs
only: on CUDA the loader dequantizes a quantized checkpoint and refuses int8 and int4
(``replicas.model.device_defaults``), and a layer moved there raises rather than unpack or cast
its weight on every call. benchmarks/README.md (``engine-vs-llamacpp``) has the figures.

Schemes (``w`` a weight, ``q`` its stored code):

* ``int8``: ``w = q * scale[n]``, ``q`` in [-127, 127], one scale per output row.
* ``int4``: ``w = (q - 8) * scale[n, g] + zero[n, g]``, ``q`` in [0, 15], one scale and zero per
  row and group of ``GROUP_SIZE`` input columns. GGUF ``Q4_0`` (``d * (q - 8)``) and ``Q4_1``
  (``d * q + m``) blocks are exactly this grouping (``scale = d``; ``zero = 0`` or
  ``m + 8 d``), and so are ``Q4_K``'s (``scale = D sc``, ``zero = 8 scale - Dmin m``), so
  their codes are used as stored, without requantizing.

Strata's own products (``kernel="strata"``; ``replicas/model/quantized_mm.cpp``, built with
the native library) keep int4 as ``w = d * q + m`` and int8 as ``w = d * q`` with float16 ``d``
(and ``m``) per row and group of ``GROUP_SIZE`` in tiles of 16 rows (a ``Q4_K`` weight's own
6-bit ``sc`` and ``m`` codes under its float16 ``D`` and ``Dmin`` instead; a ``Q6_K`` weight
as stored, in 6 bits: ``replicas.model.six_bit``; a ``Q2_K`` one in 2: ``two_bit``), and
quantize the activations per group to int8, so that a group's product is integer
multiply-adds (AVX-512 VNNI, AVX2 or plain C++, bitwise the same); ``auto`` measures them
against torch's under the native stack (docs/design.md, "Strata's int4 and int8 products").
The activations take two int8 passes (the second quantizing what the first left: about 15
bits) or one (8 bits, as llama.cpp does, and half the integer work), per projection:
``ACTIVATION_PASSES`` (one for a layer's fused gate and up projection, two for the rest;
``quantize_model``).

Only linear layers are quantized (every projection of every block and the LM head); the token
embedding, which is only gathered, stays dense.
"""

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import nn

from replicas.model.six_bit import SixBitRows, six_bit_weight, strata_six_bit
from replicas.model.two_bit import TwoBitRows, strata_two_bit, two_bit_weight


class Int4Groups(NamedTuple):
    """A weight [N, K] as ``(codes - 8) * scale + zero``, one scale and zero per row and group
    of ``GROUP_SIZE`` columns."""

    codes: torch.Tensor  # [N, K] integers in [0, 15]; [0, 31] for a 5-bit GGUF weight
    scale: torch.Tensor  # [N, K / GROUP_SIZE] float32
    zero: torch.Tensor  # [N, K / GROUP_SIZE] float32
    # A GGUF Q4_K weight's own scales, [N, K / GROUP_SIZE, 4] float32 (D, -Dmin, sc, mn) per
    # group, D and Dmin the same for a block's 8 groups: scale = D sc, zero = 8 scale - Dmin mn.
    k_quant: torch.Tensor | None = None
    # The codes index a GGUF IQ4 weight's 16 levels (``IQ4_VALUES``): w = level * scale, zero
    # unused; Strata's kernel only.
    levels: bool = False


QUANTIZATIONS = ("none", "int8", "int4")
"""What ``replicas.config`` accepts besides ``auto`` (``replicas.model.autotune``)."""
INT4_KERNELS = ("auto", "strata", "torch")
"""``int4_kernel``'s values: Strata's product, torch's, or the faster measured."""

GROUP_SIZE = 32
_CHUNK_ROWS = 4096  # rows quantized at once (a multiple of the kernels' tiles of 16 and 64)
COMPUTE_DTYPE = torch.bfloat16
_INT4_TILE_ROWS = 64  # output sizes the CPU int4 kernels take: multiples of their widest tile
_FLOAT16_MIN_NORMAL = 2.0**-14
ACTIVATION_PASSES = {"wqkv": 2, "wo": 2, "w13": 1, "w2": 2, "output": 2}
"""Strata's products: the activations' int8 passes of each projection (a layer's fused query,
key and value; its attention output; its fused gate and up; its down; the LM head). One pass is
half the integer work of two, and the gate and up projection is half a layer's multiply-adds;
SmolLM2 Q4_1's perplexity of tests/data/perplexity.txt: 32.57 with two passes everywhere, 32.68
with one on ``w13``, 32.99 with one on ``wqkv``, 32.65 with one on ``wo`` and ``w2``, 33.31 with
one everywhere (llama.cpp 32.66-32.85 by build). One pass on ``wo`` and ``w2`` moves greedy
answers to the 8-bit activations' own: asked for the capital of France, SmolLM2 answers
"L'Étoile de la Cité, ..." as llama.cpp does; with one pass on ``w13`` alone it answers
"The capital of France is Paris.", as with two passes everywhere or float weights."""


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` kept quantized (see the module docstring).

    Built with ``int8``, ``int4`` (quantizing a float weight) or ``int4_groups`` (codes, scales
    and zeros as a GGUF file stores them). Buffers, not parameters: nothing here trains.
    """

    def __init__(
        self,
        scheme: str,
        in_features: int,
        out_features: int,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: str = "torch",
        passes: int = 2,
    ) -> None:
        super().__init__()
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {passes!r}")
        self.scheme = scheme
        self.kernel = kernel  # "torch" (its packed kernels) or "strata" (Strata's)
        self.passes = passes  # Strata's products: the activations' int8 passes
        self.in_features = in_features
        self.out_features = out_features
        # int8: [N, K], or Strata's [N / 16, K / 4, 64]; int4: torch's packing, or Strata's
        # [N / 16, K / 8, 64] uint8
        self.register_buffer("weight", weight)
        # int8: [N], or Strata's [N / 16, K / GROUP_SIZE, 16] float16 (d); int4: torch's
        # [K / GROUP_SIZE, N, 2] (scale, zero), or Strata's [N / 16, K / GROUP_SIZE, 2, 16]
        # float16 (d, m)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def int8(
        cls,
        weight: torch.Tensor | Sequence[torch.Tensor],
        bias: torch.Tensor | None = None,
        kernel: str | None = "torch",
        passes: int = 2,
    ) -> "QuantizedLinear":
        """Symmetric int8 of a float ``weight`` [N, K]: per row for torch's kernel; per row and
        group of ``GROUP_SIZE`` columns with float16 scales for Strata's (``kernel``
        ``strata``, or ``None`` for Strata's where its library is built and the weight fits its
        layout), which keeps a GGUF ``Q8_0`` weight's codes and scales as stored. ``passes``:
        Strata's product quantizes the activations in one int8 pass or two (see the module
        docstring). A sequence of weights is their rows one after the other (a fused
        projection's), never copied into one float tensor."""
        n, k = _shape(weight)
        if kernel in (None, "strata"):
            strata = _strata_int8(weight)
            if strata is not None:
                return cls("int8", k, n, *strata, _bias(bias), kernel="strata", passes=passes)
            if kernel == "strata":
                raise ValueError("Strata's int8 kernel cannot take this weight here")
        codes, scales = [], []
        for rows in _chunks(weight):  # row by row: a few MiB of float at a time
            w = rows.float()
            scale = _abs_max(w, dim=1).clamp(min=1e-12) / 127
            codes.append((w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8))
            scales.append(scale)
        scale = torch.cat(scales).to(COMPUTE_DTYPE)
        return cls("int8", k, n, torch.cat(codes), scale, _bias(bias))

    @classmethod
    def six_bit(
        cls, parts: Sequence[SixBitRows], bias: torch.Tensor | None = None, passes: int = 2
    ) -> "QuantizedLinear":
        """Weights the 6-bit layout holds (``six_bit.SixBitRows``, fused by rows: a GGUF
        ``Q6_K`` or ``Q3_K`` weight's) for Strata's 6-bit product, an ``int8`` scheme whose
        scales are uint8 (``replicas.model.six_bit``); needs Strata's library."""
        packed, scales = strata_six_bit(parts)
        n = sum(p.codes.shape[0] for p in parts)
        k = packed.shape[1] // 6 * GROUP_SIZE
        return cls("int8", k, n, packed, scales, _bias(bias), kernel="strata", passes=passes)

    @classmethod
    def two_bit(
        cls, parts: Sequence[TwoBitRows], bias: torch.Tensor | None = None, passes: int = 2
    ) -> "QuantizedLinear":
        """``Q2_K`` weights as stored (``two_bit.TwoBitRows``, fused by rows) for Strata's 2-bit
        product, an ``int4`` scheme of two chunks per group (``replicas.model.two_bit``); needs
        Strata's library."""
        packed, scales = strata_two_bit(parts)
        n = sum(p.blocks.shape[0] for p in parts)
        k = packed.shape[1] // 2 * GROUP_SIZE
        return cls("int4", k, n, packed, scales, _bias(bias), kernel="strata", passes=passes)

    @classmethod
    def int4(
        cls,
        weight: torch.Tensor | Sequence[torch.Tensor],
        bias: torch.Tensor | None = None,
        kernel: str | None = None,
        passes: int = 2,
    ) -> "QuantizedLinear":
        """Asymmetric int4 of a float ``weight`` [N, K] in groups of ``GROUP_SIZE`` columns:
        each group's minimum and maximum are codes 0 and 15, its step at least float16's
        smallest normal (a group of equal values, or of values within 15 of those steps, is
        exact or within half a step: a smaller step would not be a normal float16 and would
        take the whole layer off Strata's kernel). ``kernel`` and ``passes`` as for
        ``int4_groups``; a sequence of weights as for ``int8``."""
        n, k = _shape(weight)
        _check_int4_shape(n, k)
        codes, scales, zeros = [], [], []
        for rows in _chunks(weight):  # row by row: a few MiB of float at a time
            groups = rows.float().reshape(-1, k // GROUP_SIZE, GROUP_SIZE)
            low, high = groups.amin(dim=-1), groups.amax(dim=-1)
            scale = ((high - low) / 15).clamp(min=_FLOAT16_MIN_NORMAL)
            q = (groups - low[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)
            codes.append(q.to(torch.uint8).reshape(-1, k))  # 0 to 15: exact
            scales.append(scale)
            zeros.append(low + 8 * scale)
        scale, zero = torch.cat(scales), torch.cat(zeros)
        return cls.int4_groups(torch.cat(codes), scale, zero, bias, kernel, passes)

    @classmethod
    def int4_groups(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernel: str | None = None,
        passes: int = 2,
        k_quant: torch.Tensor | None = None,
        levels: bool = False,
    ) -> "QuantizedLinear":
        """From codes [N, K] in [0, 15] (or [0, 31], a GGUF Q5 weight's, for Strata's kernel
        only) and per-group ``scale``, ``zero`` [N, K / GROUP_SIZE]:
        ``w = (codes - 8) * scale + zero`` (``levels``: ``IQ4_VALUES[codes] * scale``, Strata's
        kernel only). ``kernel``: ``strata``, ``torch``, or ``None`` for Strata's where its
        library is built and the scales fit its float16; ``passes``: the activations' int8
        passes of Strata's product (see the module docstring); ``k_quant``: the scales as a GGUF
        Q4_K file holds them (``Int4Groups.k_quant``), which Strata's kernel keeps as they
        are."""
        n, k = codes.shape
        _check_int4_shape(n, k)
        if levels:
            from replicas.model.iq4 import strata_levels

            if kernel == "torch" or (strata := strata_levels(codes, scale)) is None:
                raise ValueError("only Strata's int4 kernel takes an IQ4 weight's levels")
            return cls("int4", k, n, *strata, _bias(bias), kernel="strata", passes=passes)
        if kernel in (None, "strata"):
            strata = _strata_int4_k(codes, k_quant) if k_quant is not None else None
            if strata is None:
                strata = _strata_int4(codes, scale.float(), zero.float() - 8 * scale.float())
            if strata is not None:
                return cls("int4", k, n, *strata, _bias(bias), kernel="strata", passes=passes)
            if kernel == "strata" or int(codes.max()) > 15:
                raise ValueError("Strata's int4 kernel cannot take this weight here")
        packed = torch._convert_weight_to_int4pack_for_cpu(
            codes.cpu().to(torch.int32).contiguous(), 1
        )
        scales_and_zeros = torch.stack((scale.float(), zero.float()), dim=-1)  # [N, G, 2]
        scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous().to(COMPUTE_DTYPE)
        return cls("int4", k, n, packed, scales_and_zeros, _bias(bias))

    def dequantized(self, dtype: torch.dtype = COMPUTE_DTYPE) -> torch.Tensor:
        """The weight [N, K] as the kernels see it, in ``dtype``."""
        if self.kernel == "strata":
            unpack = _strata_int8_weight if self.scheme == "int8" else _strata_int4_weight
            if self.scheme == "int8" and self.scales.dtype == torch.uint8:  # Q6_K as stored
                unpack = six_bit_weight
            if self.weight.shape[1] * GROUP_SIZE == 2 * self.in_features:  # Q2_K as stored
                unpack = two_bit_weight
            return unpack(self.weight, self.scales, self.out_features).to(dtype)
        if self.scheme == "int8":
            return self.weight.to(dtype) * self.scales.to(dtype)[:, None]
        codes = _unpack_int4(self.weight, self.out_features, self.in_features)
        scale, zero = self.scales.to(dtype).transpose(0, 1).unbind(-1)  # [N, G] each
        groups = codes.to(dtype).reshape(self.out_features, -1, GROUP_SIZE) - 8
        w = groups * scale[..., None] + zero[..., None]
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.kernel == "strata" and x.device.type == "cpu":  # takes x as it is
            product = getattr(torch.ops.strata_native, f"{self.scheme}_mm")
            rows = x.reshape(-1, self.in_features)
            y = product(rows, self.weight, self.scales, self.out_features, self.passes)
            if self.bias is not None:
                y = y + self.bias
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        if x.device.type != "cpu":
            raise RuntimeError(
                f"QuantizedLinear ({self.scheme}) runs on CPUs only, got a {x.device.type} "
                "input; load the model with quantization none on this device"
            )
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if self.scheme == "int8":
            y = torch._weight_int8pack_mm(rows, self.weight, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.weight, GROUP_SIZE, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = f", kernel=strata, passes={self.passes}" if self.kernel == "strata" else ""
        return (
            f"{self.scheme}, in_features={self.in_features}, "
            f"out_features={self.out_features}{kernel}"
        )


def _shape(weight: torch.Tensor | Sequence[torch.Tensor]) -> tuple[int, int]:
    """[N, K] of a weight, or of weights one after the other by rows."""
    parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    return sum(p.shape[0] for p in parts), parts[0].shape[1]


def _chunks(weight: torch.Tensor | Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """A weight's rows (or those of weights one after the other), ``_CHUNK_ROWS`` at most at a
    time."""
    for part in [weight] if isinstance(weight, torch.Tensor) else weight:
        yield from part.split(_CHUNK_ROWS)


def _abs_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.abs().amax(dim)`` (the same values: both are exact) without a copy of ``x``."""
    return torch.maximum(x.amax(dim=dim), x.amin(dim=dim).neg_())


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to(COMPUTE_DTYPE).clone()


def int4_fits(n: int, k: int) -> bool:
    """Whether the int4 kernel takes a weight [n, k]."""
    return k % GROUP_SIZE == 0 and n % _INT4_TILE_ROWS == 0


def _check_int4_shape(n: int, k: int) -> None:
    if not int4_fits(n, k):
        raise ValueError(
            f"int4 needs a weight's input size to be a multiple of {GROUP_SIZE} and its output "
            f"size a multiple of {_INT4_TILE_ROWS}; got [{n}, {k}]: use quantization int8"
        )


def _unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes [N, K] (uint8) from the CPU int4 kernel's packing, read through the kernel itself.

    How torch packs the nibbles depends on the CPU it runs on (AVX-512, AVX2 and the portable
    build each have their own layout), so nothing here assumes one: the kernel multiplies the
    identity by the packed weight with every scale 1 and zero 8, which gives each code
    ``(q - 8) * 1 + 8 = q`` exactly (integers below 16 are exact in bfloat16)."""
    device = packed.device
    eye = torch.eye(k, dtype=COMPUTE_DTYPE)
    unit = torch.tensor([1.0, 8.0], dtype=COMPUTE_DTYPE).expand(k // GROUP_SIZE, n, 2)
    codes_t = torch._weight_int4pack_mm_for_cpu(
        eye, packed.cpu(), GROUP_SIZE, unit.contiguous()
    )  # [K, N]
    return codes_t.t().to(torch.uint8).to(device)


def _float16_scales(d: torch.Tensor) -> torch.Tensor | None:
    """``d`` as the float16 scales of Strata's layouts, or None where one overflows or falls
    below float16's normal range (loses more than its 10 bits of precision)."""
    d16 = d.half()
    if not torch.isfinite(d16).all() or ((d16.float() - d).abs() > d.abs() * 2**-10).any():
        return None
    return d16


def _strata_int4(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Codes [N, K] and ``w = d * q + m`` per group ([N, K / GROUP_SIZE] each) in the layout of
    Strata's int4 kernel (``replicas/model/quantized_mm.cpp``): None where its library is not
    built here, or where ``d`` loses more than float16's normal precision or ``m`` overflows
    (then torch's kernel takes the weight)."""
    from replicas.model import native_stack

    if native_stack.load_error() is not None:
        return None
    d16, m16 = _float16_scales(d), m.half()
    if d16 is None or not torch.isfinite(m16).all():
        return None
    n = codes.shape[0]
    tiles = [t.view(n // 16, 16, -1).permute(0, 2, 1) for t in (d16, m16)]  # [tile, group, row]
    return _pack_int4_codes(codes), torch.stack(tiles, dim=2).contiguous()


def _pack_int4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in the int4 kernel's chunks: [N / 16, K / 8, 64] uint8; 5-bit codes (up to
    31, a GGUF Q5 weight's) with a fifth chunk per group of 32 columns holding their high bits
    (bit 2 o + nibble of byte 4 c + r: ``quantized_mm.cpp``): [N / 16, K / 32 * 5, 64]. Packed
    by Strata's library (``weight_packing.cpp``; ``_unpack_strata_codes`` reads them back)."""
    codes = codes.to(torch.uint8).contiguous()
    return torch.ops.strata_native.pack_int4_codes(codes, int(codes.max()) > 15)


def _unpack_strata_codes(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """The codes [N, K] of ``_pack_int4_codes``'s chunks over ``groups`` groups of 32."""
    tiles, chunks, _ = packed.shape
    five = chunks == 5 * groups
    # [tile, group, octet, row, r]: the four chunks of nibbles of each group
    c = packed.view(tiles, groups, chunks // groups, 16, 4)[:, :, :4]
    codes = torch.stack((c & 15, c >> 4), dim=3)  # [tile, group, octet, nibble, row, r]
    if five:
        bits = packed.view(tiles, groups, 5, 16, 4)[:, :, 4]  # [tile, group, row, r]
        shifts = torch.arange(8, dtype=torch.uint8).view(4, 2, 1, 1)
        codes = codes | (((bits[:, :, None, None] >> shifts) & 1) << 4)
    return codes.permute(0, 4, 1, 2, 3, 5).reshape(tiles * 16, groups * GROUP_SIZE)


K_QUANT_GROUPS = 8
"""Groups of ``GROUP_SIZE`` columns under one K-quant pair of float16 scales."""


def _strata_int4_k(
    codes: torch.Tensor, k_quant: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Codes [N, K] and a Q4_K weight's own scales (``Int4Groups.k_quant``) in the layout of
    Strata's int4 kernel with K-quant scales: per tile of 16 rows and 8 groups, 320 bytes, D[16]
    and -Dmin[16] float16, then each group's sc[16] and mn[16] (``quantized_mm.cpp``). None
    where its library is not built here or K is no multiple of 8 groups."""
    from replicas.model import native_stack

    n, k = codes.shape
    if native_stack.load_error() is not None or k % (K_QUANT_GROUPS * GROUP_SIZE):
        return None
    kq = k_quant.view(n // 16, 16, -1, K_QUANT_GROUPS, 4)  # [tile, row, block, group, field]
    pairs = kq[:, :, :, 0, :2].half().permute(0, 2, 3, 1).contiguous()  # [tile, block, 2, row]
    sc_mn = kq[..., 2:].to(torch.uint8).permute(0, 2, 3, 4, 1)  # [tile, block, group, 2, row]
    blocks = pairs.shape[1]
    scales = torch.cat(
        (pairs.view(torch.uint8).view(n // 16, blocks, 64), sc_mn.reshape(n // 16, blocks, 256)),
        dim=2,
    )
    return _pack_int4_codes(codes), scales.contiguous()


def _strata_int4_weight(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weight [N, K] that ``_strata_int4``'s (or ``_strata_int4_k``'s) layout
    holds."""
    tiles = packed.shape[0]
    super_scales = scales.dtype == torch.uint8
    groups = scales.shape[1] * (K_QUANT_GROUPS if super_scales else 1)
    codes = _unpack_strata_codes(packed.view(torch.uint8), groups).float()
    if packed.dtype == torch.int8:  # IQ4's level indices, each its level + 128
        from replicas.model.gguf_dequantize import IQ4_VALUES

        codes = torch.tensor(IQ4_VALUES, dtype=torch.float32)[codes.long()] + 128
    if super_scales:  # K-quant scales: d = D sc, m = -Dmin mn
        pairs = scales[..., :64].contiguous().view(torch.float16).view(tiles, -1, 1, 2, 16)
        sc_mn = scales[..., 64:].reshape(tiles, -1, K_QUANT_GROUPS, 2, 16)
        scales = (pairs.float() * sc_mn.float()).view(tiles, -1, 2, 16)  # [tile, group, 2, row]
    d, m = (scales[:, :, i].permute(0, 2, 1).reshape(tiles * 16, -1).float() for i in (0, 1))
    w = codes.view(tiles * 16, -1, GROUP_SIZE) * d[..., None] + m[..., None]
    return w.reshape(tiles * 16, -1)[:n]


def _strata_int8(
    weight: torch.Tensor | Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A float weight [N, K] as int8 codes ``round(w / d)`` with ``d = max|w| / 127`` (float16),
    at least float16's smallest normal (a group of values that small is then within half of
    that step; a smaller ``d`` would lose precision and take the whole weight off Strata's
    kernel), per row and group of ``GROUP_SIZE`` columns, in the layout of Strata's int8
    kernel (``replicas/model/quantized_mm.cpp``; rows padded with zeros to its tiles of 16):
    None where its library is not built here, where ``K`` is not a multiple of
    ``GROUP_SIZE``, or where a scale overflows float16. Quantized and packed by Strata's library
    (``weight_packing.cpp``; ``_strata_int8_weight`` reads the layout back)."""
    from replicas.model import native_stack

    n, k = _shape(weight)
    if k % GROUP_SIZE or native_stack.load_error() is not None:
        return None
    tiles = -(-n // 16)
    packed = torch.zeros(tiles, k // 4, 64, dtype=torch.int8)
    scales = torch.zeros(tiles, k // GROUP_SIZE, 16, dtype=torch.float16)  # [tile, group, row]
    first = 0
    for rows in _chunks(weight):  # written into their tiles as they come (padding rows: zeros)
        rows = rows.detach().float().cpu().contiguous()
        if not torch.ops.strata_native.quantize_int8_into(rows, packed, scales, first):
            return None
        first += rows.shape[0]
    return packed, scales


def _strata_int8_weight(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weight [N, K] that ``_strata_int8``'s layout holds."""
    tiles, quads, _ = packed.shape
    codes = packed.view(tiles, quads, 16, 4).permute(0, 2, 1, 3).reshape(tiles * 16, quads * 4)
    d = scales.permute(0, 2, 1).reshape(tiles * 16, -1).float()
    w = codes.float().view(tiles * 16, -1, GROUP_SIZE) * d[..., None]
    return w.reshape(tiles * 16, -1)[:n]
