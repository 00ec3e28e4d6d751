"""A GGUF ``IQ4_NL`` or ``IQ4_XS`` weight kept as its 4-bit level indices by Strata's int4
product (``replicas/model/iq4.py``, ``quantized_mm4.cpp`` kBits 8): against gguf-py's own
dequantization and a float64 product, bitwise the same on every instruction path and in any
batch; and which products an int4 model serves that way."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from replicas.model.iq4 import IQ4_VALUES, iq4_groups
from replicas.model.quant import QuantizedLinear
from replicas.model.quantize import quantize_model
from tests.unit.model.quant_reference import _strata_built, activation_passes  # noqa: F401
from tests.unit.model.test_six_bit import one_layer_model, product_on_every_path

pytestmark = pytest.mark.skipif("not _strata_built()", reason="no native library here")

BLOCKS = {"IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}
"""Weights and bytes per block."""


def iq4_rows(kind: str, n: int, k: int, gen: torch.Generator) -> np.ndarray:
    """Random blocks of ``kind`` [N, bytes]: any indices and 6-bit scales, a small positive
    float16 ``d``."""
    weights, size = BLOCKS[kind]
    blocks = torch.randint(0, 256, (n, k // weights, size), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // weights, generator=gen) * 0.01 + 1e-3).half()
    if kind == "IQ4_XS":
        d = (d.float() / 20).half()
    blocks[..., 0:2] = d.view(torch.uint8).view(n, -1, 2)
    return blocks.view(n, -1).numpy()


@pytest.mark.parametrize(("kind", "passes"), [("IQ4_NL", 2), ("IQ4_XS", 1), ("IQ4_XS", 2)])
def test_an_iq4_weight_is_kept_and_multiplied_bitwise_on_every_path(kind, passes):
    n, k = 64, 512
    gen = torch.Generator().manual_seed(len(kind) + passes)
    data = iq4_rows(kind, n, k, gen)
    stored = iq4_groups(kind, torch.from_numpy(data))
    layer = QuantizedLinear.int4_groups(
        stored.codes, stored.scale, stored.zero, kernel="strata", passes=passes, levels=True
    )
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (n // 16, k // 8, 64)
    file_weight = torch.from_numpy(dequantize(data, getattr(GGMLQuantizationType, kind)))
    d16 = stored.scale.half().float()
    if kind == "IQ4_NL":  # d as stored: the file's weight exactly
        assert torch.equal(layer.dequantized(torch.float32), file_weight)
    else:  # d (ls - 32) rounded to float16
        assert torch.allclose(layer.dequantized(torch.float32), file_weight, rtol=2**-11, atol=0)
    x = torch.randn(21, k, generator=gen) * torch.linspace(0.01, 30, k)  # AMX: 16 rows, 5 left
    out = product_on_every_path(torch.ops.strata_native.int4_mm, x, layer)
    # the kernel's sums: d sum_p dx_p sum((level + 128) qx_p) - 128 d sum(x) per group
    q = (torch.tensor(IQ4_VALUES).double()[stored.codes.long()] + 128).view(n, -1, 32)
    qpart = sum(
        torch.einsum("ngk,rgk->rng", q, qx.double()) * dx.double()[:, None, :]
        for qx, dx in activation_passes(x, passes)
    )
    sx = x.float().view(len(x), -1, 32).sum(-1).double()
    d = d16.double()
    expected = (qpart * d - 128 * d * sx[:, None, :]).sum(-1)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


def test_an_int4_model_serves_iq4_products_as_levels_under_stratas_kernels_only():
    """Under Strata's kernels a product whose weights are all IQ4 takes their indices as stored,
    and one mixing IQ4 with other stored codes keeps each weight as stored in one mixed product;
    under torch's kernels both are int8."""
    from replicas.model.gguf_weights import int4_groups_of_tensor
    from tests.unit.model.test_five_bit import q5_rows

    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for kernel in ("strata", "torch"):
            model = one_layer_model()
            stored, bits = {}, {}
            for name, kind in (
                ("feed_forward.w1", "IQ4_XS"),
                ("feed_forward.w3", "IQ4_NL"),
                ("attention.wq", "IQ4_NL"),
                ("attention.wk", "IQ4_NL"),
                ("attention.wv", "Q5_0"),
            ):
                linear = model.layers[0].get_submodule(name)
                qtype = getattr(GGMLQuantizationType, kind)
                if kind == "Q5_0":
                    data = q5_rows(kind, *linear.weight.shape, gen)
                    tensor = type("T", (), {"tensor_type": qtype, "data": data})
                    stored[f"layers.0.{name}.weight"] = int4_groups_of_tensor(tensor, data)
                else:
                    data = iq4_rows(kind, *linear.weight.shape, gen)
                    stored[f"layers.0.{name}.weight"] = iq4_groups(kind, torch.from_numpy(data))
                bits[f"layers.0.{name}.weight"] = 5 if kind == "Q5_0" else 8
                linear.weight.copy_(torch.from_numpy(dequantize(data, qtype)))
            ffn, attention = model.layers[0].feed_forward, model.layers[0].attention
            gate_up = torch.cat((ffn.w1.weight, ffn.w3.weight))
            quantize_model(model, "int4", stored, bits, int4_kernel=kernel)
            if kernel == "strata":  # IQ4 q and k beside a Q5_0 v: each in its layout
                parts = attention.wqkv.parts
                assert [p.weight.dtype for p in parts] == [torch.int8] * 2 + [torch.uint8]
                assert parts[2].weight.shape[1] == 256 // 32 * 5  # 5-bit codes
            else:
                assert attention.wqkv.scheme == "int8"
            assert ffn.w13.scheme == ("int4" if kernel == "strata" else "int8"), kernel
            if kernel == "strata":
                assert ffn.w13.weight.dtype == torch.int8
                got = ffn.w13.dequantized(torch.float32)
                assert torch.allclose(got, gate_up, rtol=2**-11, atol=0)
