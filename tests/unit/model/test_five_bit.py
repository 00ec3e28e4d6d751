"""A GGUF ``Q5_0``, ``Q5_1`` or ``Q5_K`` weight kept as stored by Strata's int4 product, with a
fifth bit plane beside the nibbles (``replicas/model/quantized_mm.cpp``): against gguf-py's
own dequantization and a float64 product, bitwise the same on every instruction path and in any
batch; and which products an int4 model serves that way."""

import types

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from replicas.model.gguf_weights import int4_groups_of_tensor
from replicas.model.quant import QuantizedLinear
from replicas.model.quantize import quantize_model
from tests.unit.model.quant_reference import _strata_built, activation_passes  # noqa: F401
from tests.unit.model.test_six_bit import one_layer_model, product_on_every_path

pytestmark = pytest.mark.skipif("not _strata_built()", reason="no native library here")

BLOCKS = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q5_K": (256, 176)}
"""Weights and bytes per block."""


def q5_rows(kind: str, n: int, k: int, gen: torch.Generator) -> np.ndarray:
    """Random blocks of ``kind`` [N, bytes]: any codes, scales and fifth bits; small positive
    float16 ``d`` (and ``m`` or ``dmin``)."""
    weights, size = BLOCKS[kind]
    blocks = torch.randint(0, 256, (n, k // weights, size), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // weights, generator=gen) * 0.01 + 1e-3).half()
    blocks[..., 0:2] = d.view(torch.uint8).view(n, -1, 2)
    if kind != "Q5_0":
        blocks[..., 2:4] = (d.float() * 7.3).half().view(torch.uint8).view(n, -1, 2)
    return blocks.view(n, -1).numpy()


@pytest.mark.parametrize(("kind", "passes"), [("Q5_0", 2), ("Q5_1", 1), ("Q5_K", 2)])
def test_a_5_bit_weight_is_kept_exactly_and_multiplied_bitwise_on_every_path(kind, passes):
    n, k = 64, 512
    gen = torch.Generator().manual_seed(len(kind) + passes)
    data = q5_rows(kind, n, k, gen)
    qtype = getattr(GGMLQuantizationType, kind)
    stored = int4_groups_of_tensor(types.SimpleNamespace(tensor_type=qtype, data=data), data)
    assert int(stored.codes.max()) == 31
    layer = QuantizedLinear.int4_groups(
        stored.codes,
        stored.scale,
        stored.zero,
        kernel="strata",
        passes=passes,
        k_quant=stored.k_quant,
    )
    assert layer.weight.shape == (n // 16, k // 32 * 5, 64)
    file_weight = torch.from_numpy(dequantize(data, qtype).astype(np.float32))
    assert torch.equal(layer.dequantized(torch.float32), file_weight)
    x = torch.randn(21, k, generator=gen) * torch.linspace(0.01, 30, k)  # AMX: 16 rows, 5 left
    out = product_on_every_path(torch.ops.strata_native.int4_mm, x, layer)
    # the kernel's sums: d sum_p dx_p sum(q qx_p) + m sum(x) per group, d and m as stored
    d = stored.scale.double()
    m = stored.zero.double() - 8 * d
    q = stored.codes.double().view(n, -1, 32)
    qpart = sum(
        torch.einsum("ngk,rgk->rng", q, qx.double()) * dx.double()[:, None, :]
        for qx, dx in activation_passes(x, passes)
    )
    sx = x.float().view(len(x), -1, 32).sum(-1).double()
    expected = (qpart * d + m * sx[:, None, :]).sum(-1)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


def test_an_int4_model_serves_5_bit_products_as_stored_under_stratas_kernels_only():
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for kernel in ("strata", "torch"):
            model = one_layer_model()
            stored, bits = {}, {}
            for name, kind in (
                ("feed_forward.w1", "Q5_K"),
                ("feed_forward.w3", "Q5_K"),
                ("feed_forward.w2", "Q5_1"),
            ):
                linear = model.layers[0].get_submodule(name)
                data = q5_rows(kind, *linear.weight.shape, gen)
                qtype = getattr(GGMLQuantizationType, kind)
                tensor = types.SimpleNamespace(tensor_type=qtype, data=data)
                stored[f"layers.0.{name}.weight"] = int4_groups_of_tensor(tensor, data)
                bits[f"layers.0.{name}.weight"] = 5
                linear.weight.copy_(torch.from_numpy(dequantize(data, qtype)))
            ffn = model.layers[0].feed_forward
            gate_up, down = torch.cat((ffn.w1.weight, ffn.w3.weight)), ffn.w2.weight.clone()
            quantize_model(model, "int4", stored, bits, int4_kernel=kernel)
            for product, weight in ((ffn.w13, gate_up), (ffn.w2, down)):
                assert product.scheme == ("int4" if kernel == "strata" else "int8"), kernel
                if kernel == "strata":  # the file's weights, fifth bits and all
                    assert product.weight.shape[1] == weight.shape[1] // 32 * 5
                    assert torch.equal(product.dequantized(torch.float32), weight)
