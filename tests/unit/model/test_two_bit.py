"""Strata's 2-bit product: a GGUF ``Q2_K`` weight kept as its file stores it
(``replicas/model/two_bit.py``, ``quantized_mm2.cpp``), against gguf-py's own dequantization
and a float64 product, bitwise the same on every instruction path and in any batch."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from replicas.model.gguf_weights import unpermute_rotary
from replicas.model.quant import QuantizedLinear
from replicas.model.quantize import StoredCodes, quantize_model
from replicas.model.two_bit import TwoBitRows
from tests.unit.model.quant_reference import _strata_built, weight_reference  # noqa: F401
from tests.unit.model.test_six_bit import one_layer_model, product_on_every_path

pytestmark = pytest.mark.skipif("not _strata_built()", reason="no native library here")


def q2_k_rows(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random ``Q2_K`` rows [N, K / 256 * 84]: any codes, scales and minimums (0 and 15
    included), small positive float16 ``d`` and ``dmin`` per block."""
    blocks = torch.randint(0, 256, (n, k // 256, 84), generator=gen, dtype=torch.uint8)
    blocks[:, 0, :2] = torch.tensor([0xFF, 0x00], dtype=torch.uint8)
    for at in (80, 82):
        d = (torch.rand(n, k // 256, generator=gen) * 0.01 + 1e-3).half()
        blocks[..., at : at + 2] = d.view(torch.uint8).view(n, k // 256, 2)
    return blocks.view(n, -1)


def file_weight(rows: torch.Tensor) -> torch.Tensor:
    """gguf-py's float32 dequantization of ``Q2_K`` rows."""
    return torch.from_numpy(dequantize(rows.numpy(), GGMLQuantizationType.Q2_K).astype(np.float32))


@pytest.mark.parametrize(("n", "k", "passes"), [(40, 512, 2), (16, 768, 1), (7, 256, 2)])
def test_two_bit_keeps_a_q2_k_weight_exactly_and_multiplies_bitwise_on_every_path(n, k, passes):
    """The layout holds the file's weight exactly in the file's 2.625 bits (rows padded to the
    tiles of 16, parts fused by rows); every instruction path gives the same bits, a row alone
    the same as in a batch; the product is the float64 sum over the kernel's quantized
    activations."""
    gen = torch.Generator().manual_seed(n * k)
    parts = [q2_k_rows(n - n // 3, k, gen), q2_k_rows(n // 3, k, gen)]
    layer = QuantizedLinear.two_bit([TwoBitRows(p) for p in parts if len(p)], passes=passes)
    assert layer.scheme == "int4" and layer.scales.dtype == torch.uint8
    assert layer.weight.nbytes + layer.scales.nbytes == -(-n // 16) * 16 * k * 2.625 / 8
    weight = torch.cat([file_weight(p) for p in parts])
    assert torch.equal(layer.dequantized(torch.float32), weight)
    x = torch.randn(20, k, generator=gen) * torch.linspace(0.01, 30, k)  # AMX takes 16
    out = product_on_every_path(torch.ops.strata_native.int4_mm, x, layer)
    expected = weight_reference(weight, x, passes)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


def test_rows_put_in_another_order_are_the_weights_rows_in_that_order():
    """A Llama q or k weight's rows are put back from llama.cpp's rotary order as stored
    blocks, before the packing."""
    rows = q2_k_rows(32, 256, torch.Generator().manual_seed(5))
    order = lambda x: unpermute_rotary(x, 16)  # noqa: E731
    layer = QuantizedLinear.two_bit([TwoBitRows(rows).rows(order)])
    assert torch.equal(layer.dequantized(torch.float32), order(file_weight(rows)))


def test_an_int4_model_serves_q2_k_products_in_two_bits_and_int8_otherwise():
    """Under int4 with Strata's kernels, a product whose weights are all stored ``Q2_K`` takes
    the 2-bit layout (the file's weight); one mixing ``Q2_K`` with other weights keeps the
    ``Q2_K`` one so beside the others' int8 in one mixed product; under torch's kernels both
    are int8."""
    gen = torch.Generator().manual_seed(3)
    for kernel in ("strata", "torch"):
        stored: dict[str, StoredCodes] = {}
        bits: dict[str, int] = {}
        model = one_layer_model()
        with torch.no_grad():
            for name in ("feed_forward.w1", "feed_forward.w3", "attention.wq"):
                module = model.layers[0].get_submodule(name)
                rows = q2_k_rows(module.weight.shape[0], module.weight.shape[1], gen)
                module.weight.copy_(file_weight(rows))
                stored[f"layers.0.{name}.weight"] = TwoBitRows(rows)
                bits[f"layers.0.{name}.weight"] = 8
        ff = model.layers[0].feed_forward
        w13 = torch.cat((ff.w1.weight, ff.w3.weight))
        quantize_model(model, "int4", stored, bits, int4_kernel=kernel)
        product = model.layers[0].feed_forward.w13
        wqkv = model.layers[0].attention.wqkv
        if kernel == "strata":  # k and v are not Q2_K: int8 beside the 2-bit q
            assert [p.scheme for p in wqkv.parts] == ["int4", "int8", "int8"]
            assert wqkv.parts[0].weight.shape[1] == 256 // 32 * 2
        else:
            assert wqkv.scheme == "int8"
        assert (product.scheme == "int4") == (kernel == "strata"), kernel
        if kernel == "strata":
            assert product.weight.shape[1] == 256 // 32 * 2  # two chunks a group
            assert torch.equal(product.dequantized(torch.float32), w13)
