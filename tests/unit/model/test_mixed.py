"""One product over weights of different layouts (``replicas/model/mixed.py``): bitwise each
weight's own product on every instruction path, and what an int4 model with Strata's kernels
makes of a fused q/k/v whose weights its file stores in different types."""

import gc
import weakref

import pytest
import torch

from replicas.model.mixed import MixedLinear
from replicas.model.quant import Int4Groups, QuantizedLinear
from replicas.model.quantize import StoredCodes, quantize_model
from replicas.model.six_bit import SixBitRows
from replicas.model.two_bit import TwoBitRows
from tests.unit.model import test_six_bit
from tests.unit.model.quant_reference import _strata_built  # noqa: F401
from tests.unit.model.test_quant import _k_quant_weight
from tests.unit.model.test_six_bit import q6_k_rows
from tests.unit.model.test_two_bit import q2_k_rows

pytestmark = pytest.mark.skipif("not _strata_built()", reason="no native library here")


def parts_of_every_layout(k: int, passes: int, gen: torch.Generator) -> list[QuantizedLinear]:
    """A Q4_K weight as stored, a Q6_K one, int8 and int4 of float weights, a Q2_K one, and a
    last weight whose rows are no multiple of the tiles of 16."""
    codes, scale, zero, k_quant = _k_quant_weight(64, k, gen)
    return [
        QuantizedLinear.int4_groups(codes, scale, zero, None, "strata", passes, k_quant),
        QuantizedLinear.six_bit([SixBitRows.from_q6_k(q6_k_rows(32, k, gen))], None, passes),
        QuantizedLinear.int8(torch.randn(48, k, generator=gen), None, "strata", passes),
        QuantizedLinear.int4(torch.randn(64, k, generator=gen), None, "strata", passes),
        QuantizedLinear.two_bit([TwoBitRows(q2_k_rows(16, k, gen))], None, passes),
        QuantizedLinear.int8(torch.randn(20, k, generator=gen), None, "strata", passes),
    ]


@pytest.mark.parametrize("passes", [1, 2])
def test_a_mixed_product_is_each_weights_own_product_bitwise_on_every_path(passes):
    """Every row of the mixed product is, bit for bit, the parts' own products side by side,
    on every instruction path (AMX's blocks of 16 rows included: 37 rows) and for a row alone."""
    k = 512
    gen = torch.Generator().manual_seed(passes)
    layer = MixedLinear(parts_of_every_layout(k, passes, gen))
    x = torch.randn(37, k, generator=gen) * torch.linspace(0.01, 30, k)
    best = torch.ops.strata_native.quantized_mm_path()
    for path in range(best + 1):
        expected = torch.cat(
            [
                getattr(torch.ops.strata_native, f"{p.scheme}_mm")(
                    x, p.weight, p.scales, p.out_features, passes, path
                )
                for p in layer.parts
            ],
            dim=1,
        )
        out = torch.ops.strata_native.mixed_mm(
            x,
            [p.weight for p in layer.parts],
            [p.scales for p in layer.parts],
            [p.scheme == "int4" for p in layer.parts],
            [p.out_features for p in layer.parts],
            passes,
            path,
        )
        assert out.shape == (37, 244) and torch.equal(out, expected), path
    assert torch.equal(layer(x[5:6])[0], layer(x)[5])
    weight = layer.dequantized(torch.float32)
    assert torch.equal(weight[64:96], layer.parts[1].dequantized(torch.float32))


def test_a_mixed_product_refuses_parts_it_cannot_lay_side_by_side():
    """A weight other than the last whose rows are no multiple of 16, a part of torch's
    kernels, or parts of different input widths are refused, naming the problem."""
    gen = torch.Generator().manual_seed(0)
    parts = parts_of_every_layout(256, 2, gen)
    odd = parts[-1]
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        torch.ops.strata_native.mixed_mm(
            torch.randn(2, 256), [odd.weight] * 2, [odd.scales] * 2, [0, 0], [20, 20]
        )
    torch_int8 = QuantizedLinear.int8(torch.randn(16, 256, generator=gen), kernel="torch")
    wider = QuantizedLinear.int8(torch.randn(16, 512, generator=gen), None, "strata")
    for bad in ([parts[0], torch_int8], [parts[0], wider], [odd, parts[0]]):
        assert not MixedLinear.fits(bad)
        with pytest.raises(ValueError, match="mixed product"):
            MixedLinear(bad)


def test_an_int4_model_keeps_a_fused_products_weights_each_in_its_stored_layout():
    """A q/k/v of ``Q4_K`` query and key beside a ``Q6_K`` value (a ``Q4_K_M`` file's) is one
    mixed product holding each weight as its file stores it, not int8 of all three: the same
    outputs as the parts run apart, eager and native bitwise alike; under torch's kernels it
    stays one int8 product."""
    gen = torch.Generator().manual_seed(5)
    model = test_six_bit.one_layer_model()
    stored: dict[str, StoredCodes] = {}
    bits: dict[str, int] = {}
    attention = model.layers[0].attention
    with torch.no_grad():
        for name in ("wq", "wk"):
            codes, scale, zero, k_quant = _k_quant_weight(256, 256, gen)
            stored[f"layers.0.attention.{name}.weight"] = Int4Groups(codes, scale, zero, k_quant)
            d, neg_d_min, sc, mn = (k_quant[..., i].repeat_interleave(32, 1) for i in range(4))
            # Q4_K: D sc q - Dmin mn
            getattr(attention, name).weight.copy_(codes.double() * d * sc + neg_d_min * mn)
            bits[f"layers.0.attention.{name}.weight"] = 4
        rows = q6_k_rows(256, 256, gen)
        attention.wv.weight.copy_(test_six_bit.file_weight(rows))
        stored["layers.0.attention.wv.weight"] = SixBitRows.from_q6_k(rows)
        bits["layers.0.attention.wv.weight"] = 6
    weight = torch.cat([attention.wq.weight, attention.wk.weight, attention.wv.weight])
    torch_model = test_six_bit.one_layer_model()
    torch_model.load_state_dict(model.state_dict())
    quantize_model(model, "int4", stored, bits, int4_kernel="strata")
    quantize_model(torch_model, "int4", stored, bits, int4_kernel="torch")
    wqkv = model.layers[0].attention.wqkv
    assert isinstance(wqkv, MixedLinear)
    assert [p.scales.dtype for p in wqkv.parts] == [torch.uint8] * 3  # Q4_K and Q6_K as stored
    assert wqkv.parts[2].weight.shape[1] == 256 // 32 * 6  # the 6-bit layout
    assert torch.equal(wqkv.dequantized(torch.float32), weight)
    assert torch_model.layers[0].attention.wqkv.scheme == "int8"
    x = torch.randn(3, 256, generator=gen)
    apart = torch.cat([p(x) for p in wqkv.parts], dim=1)
    assert torch.equal(wqkv(x), apart)


def test_quantizing_keeps_no_stored_codes_alive_after_it():
    """A layer's stored codes are freed as soon as the caller drops them, without waiting for
    the garbage collector: the quantizer holds no reference cycle (a closure calling itself
    kept a whole 1.7B model's codes alive, 0.5 GiB of resident memory)."""
    model = test_six_bit.one_layer_model()
    gen = torch.Generator().manual_seed(9)
    codes, scale, zero, k_quant = _k_quant_weight(256, 256, gen)
    rows = q6_k_rows(256, 256, gen)
    stored = {
        "layers.0.attention.wq.weight": Int4Groups(codes, scale, zero, k_quant),
        "layers.0.attention.wv.weight": SixBitRows.from_q6_k(rows),
    }
    bits = {"layers.0.attention.wq.weight": 4, "layers.0.attention.wv.weight": 6}
    refs = [weakref.ref(stored["layers.0.attention.wq.weight"].codes), weakref.ref(rows)]
    del codes, rows
    gc.disable()
    try:
        quantize_model(model, "int4", stored, bits, int4_kernel="strata")
        assert isinstance(model.layers[0].attention.wqkv, MixedLinear)
        del stored
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()
