"""The KV formats of ``kv_cache_dtype`` against a float64 reference, and the cache specs they
shape."""

import typing

import pytest
import torch

from replicas.config import EngineConfig, ReplicaModelConfig
from replicas.model import KVCacheSpec, load_model
from replicas.model.kv_format import KV_FORMATS, SCALE_BYTES, float_format, kv_format

SCALED = ["int8", "fp8_e4m3"]
HEAD_DIM = 64
FP8_MAX, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT = 448.0, 3, -6


def rows_of(seed: int, n: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of very different magnitudes (1e-6 to 1e4), a row of zeros and one outlier row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEAD_DIM, generator=gen, dtype=torch.float64)
    x *= torch.logspace(-6, 4, n, dtype=torch.float64)[:, None]
    x[0] = 0
    x[1, 5] = 300.0  # one channel far above the rest of its row
    return x.to(dtype)


def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A scaled format's rows -> (codes as uint8, scales as float64), read byte by byte."""
    codes = rows[:, :HEAD_DIM]
    scale = rows[:, HEAD_DIM:].contiguous().view(torch.float16).double()
    return codes, scale


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_error_is_at_most_half_a_step(input_dtype):
    fmt = KV_FORMATS["int8"]
    x = rows_of(0, dtype=input_dtype)
    if input_dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    rows = fmt.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (len(x), HEAD_DIM + SCALE_BYTES)
    codes, scale = split(rows)
    exact = x.double()
    amax = exact.abs().amax(-1, keepdim=True)
    # The scale is amax / 127 rounded up to float16 (never below it: no code saturates).
    assert (scale >= amax / 127).all()
    nonzero = amax[:, 0] > 0
    assert (scale[nonzero] <= amax[nonzero] / 127 * (1 + 2**-10) + 2**-24).all()
    assert scale[0].item() == 0.0  # the zero row
    # Codes are round-half-even of x / scale, within +-127.
    signed = codes.view(torch.int8).double()
    assert signed.abs().max() <= 127
    safe = torch.where(scale == 0, 1.0, scale)
    torch.testing.assert_close(signed, torch.round(exact / safe), atol=0, rtol=0)
    decoded = fmt.dequantize(rows, torch.float64)
    assert ((decoded - exact).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert decoded[0].eq(0).all()


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_fp8_error_is_within_half_an_fp8_step(input_dtype):
    fmt = KV_FORMATS["fp8_e4m3"]
    x = rows_of(1, dtype=input_dtype)
    rows = fmt.quantize(x)
    _, scale = split(rows)
    exact = x.double()
    amax = exact.abs().amax(-1, keepdim=True)
    assert (scale >= amax / FP8_MAX).all()
    decoded = fmt.dequantize(rows, torch.float64)
    # Relative half-step of 3 mantissa bits; below the smallest normal, half a subnormal step.
    bound = torch.maximum(
        exact.abs() * 2.0 ** -(FP8_MANTISSA_BITS + 1),
        scale * 2.0 ** (FP8_MIN_EXPONENT - FP8_MANTISSA_BITS - 1),
    )
    assert ((decoded - exact).abs() <= bound * (1 + 1e-6)).all()
    assert decoded[0].eq(0).all()
    assert decoded.isfinite().all()


@pytest.mark.parametrize("name", SCALED)
def test_extreme_rows_neither_overflow_nor_divide_by_zero(name):
    fmt = KV_FORMATS[name]
    x = torch.tensor(
        [
            [1e-30] * HEAD_DIM,  # underflows a float16 scale: the smallest one is used
            [3e38] + [0.0] * (HEAD_DIM - 1),  # beyond float16's range: the scale is capped
            [-fmt.max_code] * HEAD_DIM,  # a scale of exactly 1
        ]
    )
    decoded = fmt.dequantize(fmt.quantize(x), torch.float32)
    assert decoded.isfinite().all()
    assert decoded[0].abs().max() <= 1e-7
    assert decoded[1, 0] == torch.finfo(torch.float16).max * fmt.max_code
    torch.testing.assert_close(decoded[2], x[2], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_float_formats_are_casts(name):
    fmt = KV_FORMATS[name]
    x = rows_of(2).clamp(-6e4, 6e4)
    rows = fmt.quantize(x)
    assert rows.dtype == fmt.storage_dtype and rows.shape == x.shape
    assert torch.equal(rows, x.to(fmt.storage_dtype))
    assert torch.equal(fmt.dequantize(rows, torch.float32), rows.float())


@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_codes_times_scales_are_the_stored_values(name, dtype):
    """Every finite code of the format (all 256 int8, the 254 non-NaN fp8), each under a few
    scales: ``split`` gives codes and scales whose product is the value torch's own casts
    decode, and ``dequantize`` that value rounded once to ``dtype``."""
    fmt = KV_FORMATS[name]
    codes = torch.arange(256, dtype=torch.uint8).view(-1, 4, HEAD_DIM // 4).repeat(1, 1, 4)
    codes = codes.reshape(-1, HEAD_DIM)  # 16 rows, each byte 4 times across them
    if name == "fp8_e4m3":
        codes[(codes & 0x7F) == 0x7F] = 0  # NaN: never written
    scales = torch.tensor([1.0, 2**-20, 0.0123, 300.0] * 4, dtype=torch.float16)[:, None]
    rows = torch.cat([codes, scales.view(torch.uint8)], dim=-1)
    exact = codes.view(fmt.code_dtype).double() * scales.double()  # torch's float8 cast
    values, row_scales = fmt.split(rows, torch.float64)
    torch.testing.assert_close(values * row_scales, exact, atol=0, rtol=0)
    wide, _ = fmt.split(rows, dtype)
    assert wide.dtype == dtype and torch.equal(wide.double(), values)  # codes exact in dtype
    torch.testing.assert_close(fmt.dequantize(rows, dtype), exact.to(dtype), atol=0, rtol=0)


def test_dequantize_takes_any_leading_shape():
    fmt = KV_FORMATS["int8"]
    rows = fmt.quantize(rows_of(3))
    flat = fmt.dequantize(rows, torch.float32)
    shaped = fmt.dequantize(rows.view(4, 16, -1), torch.float32)
    assert torch.equal(shaped.view(64, HEAD_DIM), flat)


def test_the_config_offers_every_format():
    choices = typing.get_args(ReplicaModelConfig.model_fields["kv_cache_dtype"].annotation)
    assert list(choices) == ["auto", *KV_FORMATS]
    assert kv_format("auto", torch.bfloat16) is KV_FORMATS["bfloat16"]
    assert float_format(torch.float16) is KV_FORMATS["float16"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_format("int4", torch.float32)


def test_a_bad_kv_cache_dtype_names_the_option_and_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype") as error:
        EngineConfig(kv_cache_dtype="q8_0")
    assert "fp8_e4m3" in str(error.value) and "int8" in str(error.value)


@pytest.mark.parametrize(
    "name, row_bytes, storage",
    [
        ("float32", 4 * HEAD_DIM, torch.float32),
        ("bfloat16", 2 * HEAD_DIM, torch.bfloat16),
        ("int8", HEAD_DIM + 2, torch.uint8),
        ("fp8_e4m3", HEAD_DIM + 2, torch.uint8),
    ],
)
def test_specs_count_the_scales_in_block_bytes(name, row_bytes, storage):
    model = load_model("tiny-hybrid", torch.device("cpu")).model
    assert model.args.head_dim == HEAD_DIM
    specs = model.kv_cache_specs(torch.float32, name)
    for spec in specs.values():
        assert spec.kv_format is KV_FORMATS[name] and spec.storage_dtype == storage
        shape = spec.shape(3, 16)
        assert shape[-1] * storage.itemsize == row_bytes
        cache = torch.zeros(shape, dtype=spec.storage_dtype)
        assert spec.block_bytes(16) * 3 == cache.numel() * cache.element_size()
        assert spec.block_bytes(16) == spec.num_layers * 2 * 16 * spec.num_kv_heads * row_bytes


def test_a_spec_without_a_format_stores_its_dtype():
    spec = KVCacheSpec("full", 2, 2, 8, None, torch.bfloat16)
    assert spec.kv_format is KV_FORMATS["bfloat16"]
    assert spec.shape(1, 4) == (1, 2, 2, 4, 2, 8)
    assert spec.block_bytes(4) == 2 * 2 * 4 * 2 * 8 * 2
