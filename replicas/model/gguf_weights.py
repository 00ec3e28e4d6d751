"""The weights of a GGUF file (see ``replicas.model.gguf`` for its metadata): checked against
the model before anything is read, then read one tensor at a time and dequantized a slice of
rows at a time, so that no more than one tensor's rows exist as float32 at once.

``GGUFWeights`` is what the loader builds a model from (``replicas.model.streamed``): it reads
a tensor's bytes with ``os.pread`` rather than through the reader's memory map, so the file's
pages never count in the process's resident memory (a mapped page that has been read stays in
it until the map is closed, and the reader is kept open; the whole file would then sit beside
the model it was turned into). Llama's q and k rows are put back from llama.cpp's interleaved
rotary layout as they are read (``unpermute_rotary``; dequantized by torch in
``gguf_dequantize``), and a tensor that one of Strata's layouts holds as stored can be read as
such (``int4_groups``) for a model that computes with it: the 4- and 5-bit types' codes, IQ4's
level indices (``iq4``), ``Q6_K``'s and ``Q3_K``'s 6-bit fields (``six_bit``), ``Q2_K``'s
rows (``two_bit``).
"""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replicas.model.config import ModelArgs
from replicas.model.gguf_dequantize import dequantize as _dequantize
from replicas.model.gguf_dequantize import f16 as _f16
from replicas.model.gguf_dequantize import (
    fifth_bits,
    k_quant_codes,
    nibbles,
    q3_k_six_bit,
    q4_k_codes,
)
from replicas.model.iq4 import iq4_groups
from replicas.model.quant import Int4Groups
from replicas.model.registry import build_model, get_architecture
from replicas.model.six_bit import SixBitRows
from replicas.model.tensor_names import check_tensor_names
from replicas.model.transformer import Transformer
from replicas.model.two_bit import TwoBitRows

# Tensor types dequantized at load; the names are ggml's.
GGUF_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "IQ4_NL",
    "IQ4_XS",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# Stored types whose codes an int4 model computes with as stored (``int4_groups``); the 5-bit
# ones under Strata's kernels only (``replicas.model.quantize``).
INT4_STORED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K")
_CHUNK_BYTES = 64 << 20  # float32 bytes dequantized at once
# Tensors that carry no parameter of ours (rope_freqs becomes ModelArgs.rope_scaling).
_IGNORED_TENSORS = frozenset(("rope_freqs.weight",))
_ROTARY_PROJECTIONS = (".attention.wq.", ".attention.wk.")  # our q and k, weight and bias
# Bits per weight of the layout that holds each stored type; one at more than 4 bits is never
# served at 4 from its float values. int4 holds none of Q2_K (a scale and a minimum per 16
# weights), Q3_K (a scale per 16) and IQ4's (16 levels that are not evenly spaced): quantized
# again from their floats they lost 19-38% perplexity on the shipped model (benchmarks/README.md).
# Under Strata's kernels Q3_K is kept exactly in the 6-bit layout (``q3_k_six_bit``), Q2_K in
# the 2-bit one (``two_bit``) and IQ4's as their level indices (``iq4``); otherwise they are
# int8 (the bits below).
_TYPE_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5}
_TYPE_BITS |= {"Q5_K": 5, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q3_K": 6, "Q2_K": 8}
_TYPE_BITS |= {"IQ4_NL": 8, "IQ4_XS": 8}
_SIX_BIT_TYPES = ("Q6_K", "Q3_K")  # read as the 6-bit layout's fields (``int4_groups``)
_LEVEL_TYPES = ("IQ4_NL", "IQ4_XS")  # read as level indices (``iq4.iq4_groups``)


class GGUFWeights:
    """The weights of an open GGUF file for a model of ``args``, by our parameter names.

    Raises ValueError naming missing, unexpected or mis-shaped tensors and tensor types that
    cannot be dequantized, before anything is read.
    """

    def __init__(self, reader: Any, args: ModelArgs, path: str | Path = "") -> None:
        self.path = str(path or getattr(reader, "path", "") or getattr(reader.data, "filename", ""))
        with torch.device("meta"):
            model = build_model(args)
        self._tensors = _checked_tensors(model, reader, self.path)
        architecture = get_architecture(args.architecture)
        self._rotary = {
            name
            for name in self._tensors
            if architecture.gguf_interleaved_rotary and any(p in name for p in _ROTARY_PROJECTIONS)
        }
        self._head_dim = args.head_dim
        self.stored_bits = {n: _TYPE_BITS[t.tensor_type.name] for n, t in self._tensors.items()}
        self.files = [self.path]

    @property
    def is_quantized(self) -> bool:
        return any(bits <= 8 for bits in self.stored_bits.values())

    def copy_into(self, name: str, target: torch.Tensor) -> None:
        """Parameter ``name`` dequantized into ``target`` (cast to its dtype), a slice of rows at
        a time."""
        tensor = self._tensors[name]
        unpermute = name in self._rotary
        with open(self.path, "rb") as f, torch.no_grad():
            group = self._head_dim if unpermute else 1
            for start, values in _dequantized_rows(tensor, group, f.fileno()):
                if unpermute:
                    values = unpermute_rotary(values, self._head_dim)
                target[start : start + values.shape[0]].copy_(values)

    def int4_groups(self, name: str) -> Int4Groups | SixBitRows | TwoBitRows | None:
        """Parameter ``name``'s stored codes where it is stored as ``Q4_0``, ``Q4_1``, ``Q4_K``
        or a 5-bit type (``INT4_STORED_TYPES``) or its level indices (``IQ4_NL``, ``IQ4_XS``:
        ``iq4.iq4_groups``), its fields where it is ``Q6_K`` (Strata's 6-bit
        product takes them as stored) or ``Q3_K`` (``q3_k_six_bit``: the same values), its
        rows as stored where it is ``Q2_K`` (for Strata's 2-bit product), rows in our order;
        else None."""
        tensor = self._tensors.get(name)
        kind = None if tensor is None else tensor.tensor_type.name
        if kind not in (*INT4_STORED_TYPES, *_SIX_BIT_TYPES, *_LEVEL_TYPES, "Q2_K"):
            return None
        with open(self.path, "rb") as f:
            data = _read_rows(tensor, 0, tensor.data.shape[0], f.fileno())
        if kind == "Q2_K":
            two = TwoBitRows(torch.from_numpy(np.require(data, requirements=("C", "W"))))
            if name in self._rotary:
                two = two.rows(lambda x: unpermute_rotary(x, self._head_dim))
            return two
        if kind in _LEVEL_TYPES:
            data = iq4_groups(kind, torch.from_numpy(np.require(data, requirements=("C", "W"))))
        if kind in _SIX_BIT_TYPES:
            rows = torch.from_numpy(np.require(data, requirements=("C", "W")))
            six = q3_k_six_bit(rows) if kind == "Q3_K" else SixBitRows.from_q6_k(rows)
            if name in self._rotary:
                six = six.rows(lambda x: unpermute_rotary(x, self._head_dim))
            return six
        stored = data if kind in _LEVEL_TYPES else int4_groups_of_tensor(tensor, data)
        if name in self._rotary:
            stored = stored._replace(
                **{
                    field: unpermute_rotary(x, self._head_dim)
                    for field, x in stored._asdict().items()
                    if isinstance(x, torch.Tensor)
                }
            )
        return stored


def _checked_tensors(model: Transformer, reader: Any, path: str) -> dict[str, Any]:
    """The file's tensors by ``model``'s parameter names, checked against its parameters."""
    names = get_architecture(model.args.architecture).gguf_tensor_names
    params = {names.tensor_name(name): p for name, p in model.named_parameters()}
    tensors = {t.name: t for t in reader.tensors if t.name not in _IGNORED_TENSORS}
    check_tensor_names(params, tensors, f"GGUF file {path}")
    unsupported = sorted(
        f"{key} ({t.tensor_type.name})"
        for key, t in tensors.items()
        if t.tensor_type.name not in GGUF_TENSOR_TYPES
    )
    if unsupported:
        raise ValueError(
            f"GGUF file {path} has tensors of types Strata cannot dequantize: "
            + ", ".join(unsupported)
            + "; supported: "
            + ", ".join(GGUF_TENSOR_TYPES)
        )
    for key, t in tensors.items():
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != tuple(params[key].shape):
            raise ValueError(
                f"tensor {key} in {Path(str(path)).name} has shape {shape}, "
                f"expected {tuple(params[key].shape)}"
            )
    ours = {names.tensor_name(name): name for name, _ in model.named_parameters()}
    return {ours[key]: t for key, t in tensors.items()}


def load_gguf_weights(model: Transformer, reader: Any, path: str | Path = "") -> None:
    """Copies every weight of ``model`` from an open GGUF file, dequantized to the parameters'
    dtype (see ``GGUFWeights``)."""
    weights = GGUFWeights(reader, model.args, path)
    for name, param in model.named_parameters():
        weights.copy_into(name, param)


def _read_rows(tensor: Any, start: int, count: int, fd: int) -> np.ndarray:
    """Rows ``start`` to ``start + count`` of ``tensor`` as stored (the whole of a 1-D one),
    read from the file rather than its map."""
    data = tensor.data  # the reader's view of the map: only its shape and dtype are used
    if data.ndim == 1:
        start, count = 0, 1
        row_bytes = data.nbytes
    else:
        row_bytes = data[0].nbytes
    raw = os.pread(fd, count * row_bytes, int(tensor.data_offset) + start * row_bytes)
    if len(raw) != count * row_bytes:
        raise ValueError(f"GGUF tensor {tensor.name} is cut short in its file")
    array = np.frombuffer(bytearray(raw), dtype=data.dtype)
    return array if data.ndim == 1 else array.reshape(count, *data.shape[1:])


def _dequantized_rows(tensor: Any, group: int, fd: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float32 rows) of ``tensor``, a few MiB at a time, in multiples of
    ``group`` rows."""
    data = tensor.data
    if data.ndim == 1:
        values = _dequantize(tensor, _read_rows(tensor, 0, 1, fd))
        yield 0, torch.from_numpy(np.ascontiguousarray(values))
        return
    rows = data.shape[0]
    row_values = int(tensor.n_elements) // rows
    step = max(group, _CHUNK_BYTES // (4 * row_values) // group * group)
    for start in range(0, rows, step):
        values = _dequantize(tensor, _read_rows(tensor, start, min(step, rows - start), fd))
        yield start, torch.from_numpy(np.ascontiguousarray(values))


def unpermute_rotary(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Undoes llama.cpp's converter on Llama q/k rows (``[heads * head_dim, ...]``): within each
    head it stored the rotary pairs interleaved (row ``2j + k`` holds half ``k``, index ``j``);
    we keep the two halves apart (row ``k * head_dim / 2 + j``)."""
    shape = rows.shape
    heads = rows.reshape(-1, head_dim // 2, 2, *shape[1:])
    return heads.transpose(1, 2).reshape(shape)


def permute_rotary(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama q/k rows; the inverse of ``unpermute_rotary``."""
    shape = rows.shape
    heads = rows.reshape(-1, 2, head_dim // 2, *shape[1:])
    return heads.transpose(1, 2).reshape(shape)


def gguf_weight_bits(model: Transformer, reader: Any) -> dict[str, int]:
    """Bits per weight as stored in the file, by ``model``'s parameter name."""
    names = get_architecture(model.args.architecture).gguf_tensor_names
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return {
        name: _TYPE_BITS[types[names.tensor_name(name)]]
        for name, _ in model.named_parameters()
        if names.tensor_name(name) in types
    }


def gguf_int4_groups(model: Transformer, reader: Any) -> dict[str, Int4Groups]:
    """The stored codes of every ``Q4_0``, ``Q4_1`` and ``Q4_K`` weight, by ``model``'s
    parameter name, rows in ``model``'s order (Llama's rotary rows put back as
    ``load_gguf_weights`` does)."""
    weights = GGUFWeights(reader, model.args)
    groups = {name: weights.int4_groups(name) for name, _ in model.named_parameters()}
    return {name: g for name, g in groups.items() if g is not None}


def int4_groups_of_tensor(tensor: Any, data: np.ndarray | None = None) -> Int4Groups:
    """The codes, scales and zeros of a ``Q4_0``, ``Q4_1``, ``Q4_K``, ``Q5_0``, ``Q5_1`` or
    ``Q5_K`` tensor [N, K] as stored (its bytes ``data``, read from the reader's map where not
    given); a 5-bit type's codes are in [0, 31].

    A ``Q4_1`` block of 32 weights is ``d`` (f16), ``m`` (f16) and 16 bytes of codes: weight
    ``j < 16`` is the low nibble of byte ``j``, weight ``j + 16`` its high nibble, and its value
    ``d * q + m``; a ``Q4_0`` block has no ``m`` and the value ``d * (q - 8)``. ``Q5_1`` and
    ``Q5_0`` put 4 bytes of fifth bits (bit ``j`` of weight ``j``) before the nibbles, and
    ``Q5_0``'s value is ``d * (q - 16)``. A ``Q4_K`` block of 256 is eight groups of 32 of
    value ``(d sc) q - dmin m`` (``_q4_k``): the same grouping with ``scale = d sc`` and
    ``zero = 8 d sc - dmin m``; ``Q5_K`` adds 32 bytes of fifth bits (bit ``g`` of byte ``l``:
    group ``g``'s weight ``l``).
    """
    data = np.asarray(tensor.data if data is None else data)
    kind = tensor.tensor_type.name
    if kind in ("Q4_K", "Q5_K"):
        rows = torch.from_numpy(np.require(data, requirements=("C", "W")))
        return _k_quant_groups(rows, five=kind == "Q5_K")
    has_min, five = kind in ("Q4_1", "Q5_1"), kind in ("Q5_0", "Q5_1")
    size = 18 + 2 * has_min + 4 * five
    blocks = torch.from_numpy(np.require(data, requirements=("C", "W")).reshape(-1, size))
    at = 2 + 2 * has_min  # where the fifth bits, then the nibbles, start
    codes = nibbles(blocks[:, at + 4 * five :])  # [N x blocks, 32]
    if five:
        codes = codes | fifth_bits(blocks[:, at : at + 4])
    rows = data.shape[0]
    scale = _f16(blocks, 0).view(rows, -1)
    zero = _f16(blocks, 2).view(rows, -1) + 8 * scale if has_min else (8 - 8 * (1 + five)) * scale
    return Int4Groups(codes.view(rows, -1), scale, zero)


def _k_quant_groups(data: torch.Tensor, five: bool = False) -> Int4Groups:
    """``Q4_K`` (or ``Q5_K``) rows [N, bytes] as ``Int4Groups`` (``int4_groups_of_tensor``)."""
    n = data.shape[0]
    blocks = data.view(-1, 176 if five else 144)
    sc, m = q4_k_codes(blocks)
    codes = k_quant_codes(blocks, five).view(n, -1)  # [N, K]
    d, d_min = _f16(blocks, 0).expand_as(sc), _f16(blocks, 2).expand_as(m)
    scale, low = (d * sc).view(n, -1), (d_min * m).view(n, -1)
    k_quant = torch.stack((d, -d_min, sc, m), dim=-1).view(n, -1, 4)
    return Int4Groups(codes, scale, 8 * scale - low, k_quant)
