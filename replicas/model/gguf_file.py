"""A GGUF file's header read in one pass: its metadata as Python values and its tensors as
gguf-py's ``ReaderTensor`` records over a memory map of the file.

gguf-py's own ``GGUFReader`` keeps every metadata item as numpy views of the map, a few per
string, so a vocabulary of 50,000 tokens and as many merges is hundreds of thousands of views,
made on every start of every process that reads the file (the config's capacity plan, each
replica); this reads the same header with ``struct`` into plain values instead (figures in
benchmarks/README.md). The format (version 2 and 3, little-endian): the magic, the version,
the tensor and metadata counts, the metadata (a key, a value type and a value, arrays
included), each tensor's name, dimensions (innermost first), type and offset, then the data
at ``general.alignment`` (32 by default)."""

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf-py's GGUFValueType) by number: their struct formats, strings and
# arrays apart.
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_ARRAY_DTYPES = {kind: np.dtype("<" + f) for kind, f in _SCALARS.items()}
# Tensor types that gguf-py reads as values, not as bytes
_VALUE_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8}
_VALUE_DTYPES |= {"I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFFile:
    """The header of the GGUF file ``path``: ``values`` (its metadata by key, as Python values:
    numbers, strings, lists of them), ``tensors`` (``ReaderTensor`` records, ``data`` a view of
    the file's map and ``field`` None) and ``data`` (the map itself, opened read-only).
    Raises ValueError naming what is malformed."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        self._at = 0
        try:
            tensor_count, kv_count = self._preamble()
            self.values: dict[str, Any] = {}
            for _ in range(kv_count):
                key = self._string()
                self.values[key] = self._value(self._unpack("<I"))
            infos = [self._tensor_info() for _ in range(tensor_count)]
        except (struct.error, UnicodeDecodeError, IndexError) as error:
            raise ValueError(f"malformed GGUF header at byte {self._at}: {error}") from error
        self.alignment = self._alignment()
        self.data_offset = -(-self._at // self.alignment) * self.alignment
        self.tensors = self._tensors(infos)

    def _preamble(self) -> tuple[int, int]:
        if bytes(self._map[:4]) != MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self._at = 4
        version = self._unpack("<I")
        if version not in VERSIONS:
            swapped = version & 0xFFFF == 0
            raise ValueError(
                "a big-endian GGUF file; Strata reads little-endian ones"
                if swapped
                else f"GGUF version {version}; Strata reads versions 2 and 3"
            )
        return self._unpack("<Q"), self._unpack("<Q")

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        (size,) = struct.unpack_from("<Q", self._map, self._at)
        start = self._at + 8
        self._at = start + size
        if self._at > len(self._map):
            raise IndexError("a string runs past the end of the file")
        return self._map[start : self._at].decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self._at}")
        item, count = self._unpack("<I"), self._unpack("<Q")
        if item in _ARRAY_DTYPES:
            dtype = _ARRAY_DTYPES[item]
            values = np.frombuffer(self._map, dtype, count, self._at)
            self._at += count * dtype.itemsize
            return values.tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
        return name, dims, self._unpack("<I"), self._unpack("<Q")

    def _alignment(self) -> int:
        alignment = self.values.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"GGUF general.alignment {alignment!r} is not a power of two")
        return alignment

    def _tensors(self, infos: list[tuple[str, list[int], int, int]]) -> list[ReaderTensor]:
        tensors, names = [], set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise ValueError(f"GGUF tensor {name} appears twice")
            names.add(name)
            try:
                tensor_type = GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"GGUF tensor {name} has an unknown type {kind}") from None
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            count = int(np.prod(dims, dtype=np.int64))
            shape = tuple(reversed(dims))
            at = self.data_offset + offset
            dtype = _VALUE_DTYPES.get(tensor_type.name)
            if dtype is None:  # quantized: [..., bytes per row]
                if shape[-1] % block:
                    raise ValueError(f"GGUF tensor {name}'s rows are not whole {block}-blocks")
                shape = (*shape[:-1], shape[-1] // block * block_bytes)
                dtype = np.uint8
            n_bytes = count * block_bytes // block
            if at + n_bytes > len(self.data):
                raise ValueError(f"GGUF tensor {name} runs past the end of the file")
            data = np.frombuffer(self._map, dtype, n_bytes // np.dtype(dtype).itemsize, at)
            dims_array = np.array(dims, dtype=np.uint64)
            data = data.reshape(shape)
            tensors.append(
                ReaderTensor(name, tensor_type, dims_array, count, n_bytes, at, data, None)
            )
        return tensors
