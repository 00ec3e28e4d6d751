"""Strata's library packing weights at load (``weight_packing.cpp``) against the layouts'
readers written in torch ops: int4 chunks read back by ``_unpack_strata_codes``, a ``Q6_K``
weight's fields and ``Q4_K``/``Q5_K`` codes as torch's ops take them out of their blocks."""

import pytest
import torch

from replicas.model.gguf_dequantize import k_quant_codes_torch
from replicas.model.quant import _pack_int4_codes, _unpack_strata_codes
from replicas.model.six_bit import q6_k_fields_torch
from tests.unit.model.quant_reference import _strata_built  # noqa: F401

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
