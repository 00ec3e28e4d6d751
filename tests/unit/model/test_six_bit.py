"""Strata's 6-bit product: a GGUF ``Q6_K`` weight kept as its file stores it
(``replicas/model/six_bit.py``, ``quantized_mm6.cpp``), against gguf-py's own dequantization
and a float64 product, bitwise the same on every instruction path and in any batch."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from replicas.model.quant import QuantizedLinear
from replicas.model.quantize import StoredCodes, quantize_model
from replicas.model.six_bit import SixBitRows
from tests.unit.model.quant_reference import _strata_built, weight_reference  # noqa: F401

pytestmark = pytest.mark.skipif("not _strata_built()", reason="no native library here")


def q6_k_rows(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random ``Q6_K`` rows [N, K / 256 * 210]: any codes and int8 scales (the extremes
    included), a small positive float16 ``d`` per block."""
    blocks = torch.randint(0, 256, (n, k // 256, 210), generator=gen, dtype=torch.uint8)
    blocks[:, 0, 192:194] = torch.tensor([0x80, 0x7F], dtype=torch.uint8)  # sc -128 and 127
    d = (torch.rand(n, k // 256, generator=gen) * 0.01 + 1e-3).half()
    blocks[..., 208:210] = d.view(torch.uint8).view(n, k // 256, 2)
    return blocks.view(n, -1)


def file_weight(rows: torch.Tensor) -> torch.Tensor:
    """gguf-py's float32 dequantization of ``Q6_K`` rows."""
    return torch.from_numpy(dequantize(rows.numpy(), GGMLQuantizationType.Q6_K).astype(np.float32))


@pytest.mark.parametrize(("n", "k", "passes"), [(40, 512, 2), (16, 768, 1), (7, 256, 2)])
def test_six_bit_keeps_a_q6_k_weight_exactly_and_multiplies_bitwise_on_every_path(n, k, passes):
    """The layout holds the file's weight exactly (rows padded to the tiles of 16, parts fused
    by rows); every instruction path gives the same bits, a row alone the same as in a batch;
    the product is the float64 sum over the kernel's quantized activations."""
    gen = torch.Generator().manual_seed(n * k)
    parts = [q6_k_rows(n - n // 3, k, gen), q6_k_rows(n // 3, k, gen)]
    layer = QuantizedLinear.six_bit(
        [SixBitRows.from_q6_k(p) for p in parts if len(p)], passes=passes
    )
    assert layer.scheme == "int8" and layer.scales.dtype == torch.uint8
    assert layer.weight.nbytes + layer.scales.nbytes == -(-n // 16) * 16 * k * 6.5625 / 8
    weight = torch.cat([file_weight(p) for p in parts])
    assert torch.equal(layer.dequantized(torch.float32), weight)
    x = torch.randn(6, k, generator=gen) * torch.linspace(0.01, 30, k)
    out = product_on_every_path(torch.ops.strata_native.int8_mm, x, layer)
    expected = weight_reference(weight, x, passes)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


def product_on_every_path(op, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    """``op`` (``int4_mm`` or ``int8_mm``) of ``x`` and ``layer``'s layout, after checking that
    every instruction path gives the same bits and that a row alone gives its bits in the batch."""
    n, passes = layer.out_features, layer.passes
    best = torch.ops.strata_native.quantized_mm_path()
    outs = [op(x, layer.weight, layer.scales, n, passes, path) for path in range(best + 1)]
    assert all(torch.equal(outs[0], out) for out in outs[1:]), best
    alone = op(x[2:3], layer.weight, layer.scales, n, passes)
    assert torch.equal(alone[0], outs[-1][2])
    return outs[0]


def one_layer_model() -> torch.nn.Module:
    """A one-layer model whose every projection has a multiple of 256 columns (K-quant blocks)."""
    from replicas.model.config import ModelArgs
    from replicas.model.registry import build_model

    sizes = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 4}
    return build_model(ModelArgs(vocab_size=64, num_layers=1, head_dim=64, **sizes)).eval()


def test_an_int4_model_serves_q6_k_products_in_six_bits_and_int8_otherwise():
    """Under int4 with Strata's kernels, a product whose weights are all stored ``Q6_K`` takes
    the 6-bit layout (the file's weight, 6.56 bits); one mixing ``Q6_K`` with other weights
    keeps the ``Q6_K`` one so beside the others' int8 in one mixed product; under torch's
    kernels both are int8 (8.5 bits)."""
    gen = torch.Generator().manual_seed(3)
    stored: dict[str, StoredCodes] = {}
    bits: dict[str, int] = {}
    with torch.no_grad():
        for kernel in ("strata", "torch"):
            model = one_layer_model()
            for name in ("feed_forward.w2", "attention.wv"):
                module = model.layers[0].get_submodule(name)
                rows = q6_k_rows(module.weight.shape[0], module.weight.shape[1], gen)
                module.weight.copy_(file_weight(rows))
                stored[f"layers.0.{name}.weight"] = SixBitRows.from_q6_k(rows)
                bits[f"layers.0.{name}.weight"] = 6
            w2 = model.layers[0].feed_forward.w2.weight.clone()
            quantize_model(model, "int4", stored, bits, int4_kernel=kernel)
            product = model.layers[0].feed_forward.w2
            wqkv = model.layers[0].attention.wqkv
            if kernel == "strata":  # q and k are not Q6_K: int8 beside the 6-bit v
                assert [p.scales.dtype for p in wqkv.parts] == [torch.float16] * 2 + [torch.uint8]
            else:
                assert wqkv.scheme == "int8" and wqkv.kernel == "torch"
            assert (product.scales.dtype == torch.uint8) == (kernel == "strata"), kernel
            if kernel == "strata":
                assert torch.equal(product.dequantized(torch.float32), w2)
