"""Strata's library packing weights at load (``weight_packing.cpp``) against the layouts'
readers written in torch ops: int4 chunks read back by ``_unpack_strata_codes``, a ``Q6_K``
weight's fields and ``Q3_K``/``Q4_K``/``Q5_K`` codes as torch's ops take them out of their
blocks, ``Q2_K`` and IQ4 values as gguf-py's, int8 groups rounded as torch's ops round them."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from replicas.model.gguf_dequantize import k_quant_codes_torch, q3_k_fields_torch
from replicas.model.quant import _pack_int4_codes, _strata_int8_weight, _unpack_strata_codes
from replicas.model.six_bit import q6_k_fields_torch
from tests.unit.model.quant_reference import _strata_built  # noqa: F401
from tests.unit.model.test_gguf_dequantize import random_blocks

pytestmark = pytest.mark.skipif("not _strata_built()", reason="no native library here")


@pytest.mark.parametrize(("top", "chunks_per_group"), [(16, 4), (32, 5)])
def test_int4_chunks_read_back_as_their_codes(top, chunks_per_group):
    """4-bit codes pack into four chunks per group of 32 columns, 5-bit ones into five."""
    gen = torch.Generator().manual_seed(top)
    codes = torch.randint(0, top, (48, 96), generator=gen, dtype=torch.uint8)
    codes[0, 0] = top - 1  # a code at the top of the range decides the layout
    packed = _pack_int4_codes(codes)
    assert packed.shape == (3, 3 * chunks_per_group, 64) and packed.dtype == torch.uint8
    assert torch.equal(_unpack_strata_codes(packed, 3), codes)


def test_q6_k_fields_are_torch_ops_fields():
    gen = torch.Generator().manual_seed(6)
    rows = torch.randint(0, 256, (5, 3 * 210), generator=gen, dtype=torch.uint8)
    got = torch.ops.strata_native.q6_k_fields(rows)
    for mine, reference in zip(got, q6_k_fields_torch(rows), strict=True):
        assert mine.dtype == reference.dtype
        assert torch.equal(mine.view(torch.uint8), reference.contiguous().view(torch.uint8))


@pytest.mark.parametrize(("five", "size"), [(False, 144), (True, 176)])
def test_k_quant_codes_are_torch_ops_codes(five, size):
    """``Q4_K`` and ``Q5_K`` blocks' codes (the fifth bits included)."""
    gen = torch.Generator().manual_seed(size)
    blocks = torch.randint(0, 256, (300, size), generator=gen, dtype=torch.uint8)
    got = torch.ops.strata_native.k_quant_codes(blocks, five)
    assert torch.equal(got, k_quant_codes_torch(blocks, five))


def test_q2_k_values_are_gguf_py_values_bit_for_bit():
    blocks = random_blocks("Q2_K", 96, seed=2)
    expected = dequantize(blocks, GGMLQuantizationType.Q2_K).astype(np.float32).reshape(96, 256)
    got = torch.ops.strata_native.q2_k_values(torch.from_numpy(blocks.copy())).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_q3_k_fields_are_torch_ops_fields():
    blocks = torch.from_numpy(random_blocks("Q3_K", 96, seed=3).copy())
    got = torch.ops.strata_native.q3_k_fields(blocks)
    for mine, reference in zip(got, q3_k_fields_torch(blocks), strict=True):
        assert mine.dtype == reference.dtype and mine.shape == reference.shape
        assert torch.equal(mine.view(torch.uint8), reference.contiguous().view(torch.uint8))


def int8_groups_reference(rows: torch.Tensor):
    """int8 codes and float16 steps per 32 columns in torch's ops, or None where a step does not
    fit float16's normal range."""
    groups = rows.reshape(rows.shape[0], -1, 32)
    d = (groups.abs().amax(dim=-1) / 127).clamp(min=2.0**-14)
    d16 = d.half()
    if not torch.isfinite(d16).all() or ((d16.float() - d).abs() > d.abs() * 2**-10).any():
        return None
    codes = (groups * (1 / d16.float())[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes.reshape(rows.shape), d16


def test_int8_groups_round_as_torch_ops_do():
    """Groups of every magnitude (below float16's normal range, zeros, codes exactly half way),
    written into the int8 layout from any row on; one that overflows float16, or holds a NaN,
    does not fit."""
    gen = torch.Generator().manual_seed(8)
    rows = torch.randn(40, 256, generator=gen) * torch.logspace(-8, 3, 40)[:, None]
    rows[3] = 0
    rows[5, 0] = 127 * 0.125  # a step of 0.125, then codes exactly half way: 0.5, 1.5, ...
    rows[5, 1:32] = (torch.arange(31) + 0.5) * 0.125
    packed = torch.zeros(3, 64, 64, dtype=torch.int8)
    scales = torch.zeros(3, 8, 16, dtype=torch.float16)
    for first, last in ((0, 24), (24, 40)):
        assert torch.ops.strata_native.quantize_int8_into(rows[first:last], packed, scales, first)
    codes, d16 = int8_groups_reference(rows)
    assert torch.equal(
        _strata_int8_weight(packed, scales, 40),
        (codes.view(40, 8, 32) * d16.float()[..., None]).view(40, 256),
    )
    assert torch.equal(packed.view(3, 64, 16, 4)[2, :, 8:], torch.zeros(64, 8, 4, dtype=torch.int8))
    for bad in (1e9, float("nan")):
        broken = rows.clone()
        broken[7, 40] = bad
        assert int8_groups_reference(broken) is None
        assert not torch.ops.strata_native.quantize_int8_into(broken, packed, scales, 0)


@pytest.mark.parametrize(("kind", "xs"), [("IQ4_NL", False), ("IQ4_XS", True)])
def test_iq4_values_are_gguf_py_values_bit_for_bit(kind, xs):
    blocks = random_blocks(kind, 64, seed=4)
    expected = dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float32).reshape(64, -1)
    got = torch.ops.strata_native.iq4_values(torch.from_numpy(blocks.copy()), xs).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
