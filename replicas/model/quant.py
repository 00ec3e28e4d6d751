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
its shape, which at bfloat16 precision flips near-tied greedy tokens. Where no packed kernel
exists (CUDA) the dense path runs. benchmarks/README.md (``engine-vs-llamacpp``) has the figures.

Schemes (``w`` a weight, ``q`` its stored code):

* ``int8``: ``w = q * scale[n]``, ``q`` in [-127, 127], one scale per output row.
* ``int4``: ``w = (q - 8) * scale[n, g] + zero[n, g]``, ``q`` in [0, 15], one scale and zero per
  row and group of ``GROUP_SIZE`` input columns. GGUF ``Q4_0`` (``d * (q - 8)``) and ``Q4_1``
  (``d * q + m``) blocks are exactly this grouping (``scale = d``; ``zero = 0`` or
  ``m + 8 d``), so their codes are used as stored, without requantizing.

Only linear layers are quantized (every projection of every block and the LM head); the token
embedding, which is only gathered, stays dense.
"""

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Int4Groups(NamedTuple):
    """A weight [N, K] as ``(codes - 8) * scale + zero``, one scale and zero per row and group
    of ``GROUP_SIZE`` columns."""

    codes: torch.Tensor  # [N, K] integers in [0, 15]
    scale: torch.Tensor  # [N, K / GROUP_SIZE] float32
    zero: torch.Tensor  # [N, K / GROUP_SIZE] float32


QUANTIZATIONS = ("none", "int8", "int4")
"""What ``replicas.config`` accepts besides ``auto`` (``replicas.model.autotune``)."""

GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16
_INT4_TILE_ROWS = 64  # output sizes the CPU int4 kernels take: multiples of their widest tile


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
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", weight)  # int8 [N, K] or the int4 kernel's packing
        self.register_buffer("scales", scales)  # [N] or [K / GROUP_SIZE, N, 2] (scale, zero)
        self.register_buffer("bias", bias)

    @classmethod
    def int8(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "QuantizedLinear":
        """Symmetric per-row int8 of a float ``weight`` [N, K]."""
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        n, k = weight.shape
        return cls("int8", k, n, codes, scale.to(COMPUTE_DTYPE), _bias(bias))

    @classmethod
    def int4(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "QuantizedLinear":
        """Asymmetric int4 of a float ``weight`` [N, K] in groups of ``GROUP_SIZE`` columns:
        each group's minimum and maximum are codes 0 and 15."""
        n, k = weight.shape
        _check_int4_shape(n, k)
        groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        return cls.int4_groups(codes.reshape(n, k), scale, low + 8 * scale, bias)

    @classmethod
    def int4_groups(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> "QuantizedLinear":
        """From codes [N, K] in [0, 15] and per-group ``scale``, ``zero`` [N, K / GROUP_SIZE]:
        ``w = (codes - 8) * scale + zero``."""
        n, k = codes.shape
        _check_int4_shape(n, k)
        packed = torch._convert_weight_to_int4pack_for_cpu(
            codes.cpu().to(torch.int32).contiguous(), 1
        )
        scales_and_zeros = torch.stack((scale.float(), zero.float()), dim=-1)  # [N, G, 2]
        scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous().to(COMPUTE_DTYPE)
        return cls("int4", k, n, packed, scales_and_zeros, _bias(bias))

    def dequantized(self, dtype: torch.dtype = COMPUTE_DTYPE) -> torch.Tensor:
        """The weight [N, K] as the kernels see it, in ``dtype``."""
        if self.scheme == "int8":
            return self.weight.to(dtype) * self.scales.to(dtype)[:, None]
        codes = _unpack_int4(self.weight, self.out_features, self.in_features)
        scale, zero = self.scales.to(dtype).transpose(0, 1).unbind(-1)  # [N, G] each
        groups = codes.to(dtype).reshape(self.out_features, -1, GROUP_SIZE) - 8
        w = groups * scale[..., None] + zero[..., None]
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if rows.device.type != "cpu":
            y = self._dense(rows)
        elif self.scheme == "int8":
            y = torch._weight_int8pack_mm(rows, self.weight, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.weight, GROUP_SIZE, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:
        """The product through a dense GEMM, where there is no packed kernel: int8's per-row
        scale is applied to the output columns (``x (q s)^T = (x q^T) s``), so the weight is only
        cast, not scaled."""
        if self.scheme == "int8":
            return F.linear(rows, self.weight.to(rows.dtype)) * self.scales
        return F.linear(rows, self.dequantized(rows.dtype))

    def extra_repr(self) -> str:
        return f"{self.scheme}, in_features={self.in_features}, out_features={self.out_features}"


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


def quantize_model(
    model: nn.Module,
    scheme: str,
    int4_groups: Mapping[str, Int4Groups] | None = None,
    stored_bits: Mapping[str, int] | None = None,
) -> None:
    """Replaces every linear layer of a ``Transformer`` by a ``QuantizedLinear`` of ``scheme``,
    in place, fusing q/k/v and gate/up into one product each (fewer kernel calls per layer).

    ``int4_groups``: stored int4 codes by parameter name (a GGUF file's Q4 tensors), used as
    they are under ``int4``. ``stored_bits``: bits per weight as stored; under ``int4`` a weight
    stored at 5 bits or more is kept at int8 rather than lose the precision its file kept, and
    so is one whose shape the int4 kernel does not take (``int4_fits``).
    """
    if scheme not in QUANTIZATIONS or scheme == "none":
        raise ValueError(f"quantization scheme must be int8 or int4, got {scheme!r}")
    groups = dict(int4_groups or {})
    bits = dict(stored_bits or {})
    if model.args.tie_word_embeddings:  # the LM head is the embedding matrix as stored
        for stored in (groups, bits):
            if "tok_embeddings.weight" in stored:
                stored["output.weight"] = stored["tok_embeddings.weight"]

    def quantized(names: list[str], linears: list[nn.Linear]) -> QuantizedLinear:
        biases = [linear.bias for linear in linears]
        bias = None if biases[0] is None else torch.cat(biases)
        weight = torch.cat([linear.weight for linear in linears])
        wanted = scheme if all(bits.get(f"{n}.weight", 16) <= 4 for n in names) else "int8"
        if wanted == "int4" and not int4_fits(*weight.shape):
            wanted = "int8"
        if wanted == "int4" and all(f"{n}.weight" in groups for n in names):
            stored = [groups[f"{n}.weight"] for n in names]
            return QuantizedLinear.int4_groups(
                *(torch.cat(parts) for parts in zip(*stored, strict=True)), bias=bias
            )
        return getattr(QuantizedLinear, wanted)(weight, bias)

    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            prefix = f"layers.{i}"
            att, ff = layer.attention, layer.feed_forward
            att.wqkv = quantized(
                [f"{prefix}.attention.{w}" for w in ("wq", "wk", "wv")], [att.wq, att.wk, att.wv]
            )
            att.wo = quantized([f"{prefix}.attention.wo"], [att.wo])
            ff.w13 = quantized([f"{prefix}.feed_forward.{w}" for w in ("w1", "w3")], [ff.w1, ff.w3])
            ff.w2 = quantized([f"{prefix}.feed_forward.w2"], [ff.w2])
            del att.wq, att.wk, att.wv, ff.w1, ff.w3
        model.output = quantized(["output"], [model.output])
