"""Quantized linear layers against dequantized references, GGUF 4-bit codes against gguf-py's
own dequantization, and quantized models end to end (caching on vs off, SmolLM2 vs float32)."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from replicas.model.quant import (
    ACTIVATION_PASSES,
    GROUP_SIZE,
    QuantizedLinear,
    _unpack_int4,
)
from replicas.model.quantize import quantize_model
from tests.unit.model.quant_reference import _strata_built, strata_reference


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 x @ weight.T + bias, with x rounded to bfloat16 as the layer multiplies it."""
    y = x.to(torch.bfloat16).double() @ weight.double().T
    return (y if bias is None else y + bias.double()).float()


def _layer(
    scheme: str, w: torch.Tensor, bias: torch.Tensor | None = None, passes: int = 2
) -> QuantizedLinear:
    """int8 or int4, through torch's kernel, or Strata's (``int8/strata``, ``int4/strata``)."""
    name, _, kernel = scheme.partition("/")
    build = QuantizedLinear.int8 if name == "int8" else QuantizedLinear.int4
    return build(w, bias, kernel=kernel or "torch", passes=passes)


KERNELS = [
    "torch",
    pytest.param(
        "strata",
        marks=pytest.mark.skipif("not _strata_built()", reason="no native library here"),
    ),
]
SCHEMES = [
    "int8",
    "int4",
    *(pytest.param(s, marks=KERNELS[1].marks) for s in ("int8/strata", "int4/strata")),
]


def test_int8_codes_are_within_half_a_step_of_the_weight():
    w = torch.randn(96, 64) * torch.linspace(0.1, 3, 96)[:, None]
    layer = QuantizedLinear.int8(w)
    assert layer.weight.dtype == torch.int8 and layer.weight.abs().max() <= 127
    step = w.abs().amax(1) / 127
    error = (layer.dequantized(torch.float32) - w).abs()
    # Half a step, plus the scale's rounding to bfloat16 (2^-9 relative) times the code.
    assert (error <= step[:, None] * (0.5 + 127 * 2**-8)).all()


def test_int4_packing_round_trips_through_torchs_kernel_layout():
    """Whatever packing torch uses on this CPU (it differs between AVX-512, AVX2 and the
    portable build), the codes read back through the kernel are the codes packed."""
    codes = torch.randint(0, 16, (192, 96), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(_unpack_int4(packed, 192, 96).int(), codes)


@pytest.mark.parametrize("kernel", KERNELS)
def test_int4_dequantized_weight_is_what_the_kernel_multiplies_by(kernel):
    """The dequantized weight against the packed kernel itself: x = I gives W^T (one-hot rows
    quantize exactly in Strata's kernel too)."""
    n, k = 128, 96
    layer = QuantizedLinear.int4(torch.randn(n, k), kernel=kernel)
    assert layer.kernel == kernel
    eye = torch.eye(k)
    by_kernel = layer(eye).T  # [N, K]: each weight, rounded once to bfloat16 by the kernel
    # Half a bfloat16 step of rounding (2^-9 relative), whichever order the kernel computes in.
    torch.testing.assert_close(layer.dequantized(torch.float32), by_kernel, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_int4_groups_dequantize_exactly(kernel):
    n, k = 128, 64
    codes = torch.randint(0, 16, (n, k))
    scale = torch.rand(n, k // GROUP_SIZE) + 0.5
    zero = torch.randn(n, k // GROUP_SIZE)
    layer = QuantizedLinear.int4_groups(codes, scale, zero, kernel=kernel)
    got = layer.dequantized(torch.float32).double()
    if kernel == "torch":  # scales and zeros kept in bfloat16, the kernel's dtype
        s, z = scale.bfloat16().double(), zero.bfloat16().double()
        expected = (codes.double() - 8).reshape(n, -1, GROUP_SIZE) * s[..., None] + z[..., None]
        tolerance = 1e-2 * s.max().item()
    else:  # d and m kept in float16, as GGUF stores them
        d, m = scale.half().double(), (zero - 8 * scale).half().double()
        expected = codes.double().reshape(n, -1, GROUP_SIZE) * d[..., None] + m[..., None]
        tolerance = 1e-6
    torch.testing.assert_close(got, expected.reshape(n, k), rtol=0, atol=tolerance)


@pytest.mark.skipif("not _strata_built()", reason="no native library here")
def test_strata_int4_takes_what_float16_keeps_and_leaves_the_rest_to_torch():
    """A scale below float16's normal range would lose precision in Strata's layout: the layer
    goes to torch's kernel; and asking for Strata's there is an error."""
    n, k = 64, 64
    codes = torch.randint(0, 16, (n, k))
    tiny = torch.full((n, k // GROUP_SIZE), 1e-6)
    assert QuantizedLinear.int4_groups(codes, tiny, tiny * 8).kernel == "torch"
    with pytest.raises(ValueError, match="Strata's int4 kernel"):
        QuantizedLinear.int4_groups(codes, tiny, tiny * 8, kernel="strata")
    assert QuantizedLinear.int4_groups(codes, tiny * 1e3, tiny).kernel == "strata"


@pytest.mark.skipif("not _strata_built()", reason="no native library here")
def test_a_float_weight_with_a_group_of_equal_values_keeps_strata_int4():
    """A group whose values are all equal (a ``Q3_K`` weight's two zero-scaled sub-blocks, a
    pruned block) has no range: its step is float16's smallest normal, not one below it that
    would send the whole layer to torch's kernel, and the group comes back as its float16
    offset holds it."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 128, generator=gen) * 0.02
    weight[5, 32:64] = 0.0
    weight[9, 64:96] = 0.0125
    layer = QuantizedLinear.int4(weight)
    assert layer.kernel == "strata"
    back = layer.dequantized(torch.float32)
    assert torch.equal(back[5, 32:64], weight[5, 32:64])
    assert torch.equal(back[9, 64:96], torch.full((32,), 0.0125).half().float())
    assert (back - weight).abs().max() <= 0.02 * 8 / 15 / 2 + 1e-3  # about half a step


@pytest.mark.skipif("not _strata_built()", reason="no native library here")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(64, 32), (192, 256), (320, 1536)])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("rows", [7, 40])
def test_strata_products_are_bitwise_the_same_on_every_instruction_path(
    scheme, shape, passes, rows
):
    """AMX (blocks of 16 rows), AVX-512 VNNI, AVX2 and plain C++ (each path this CPU has) give
    the same bits: integer sums are exact and the float steps are the same on each."""
    gen = torch.Generator().manual_seed(shape[1])
    layer = _layer(f"{scheme}/strata", torch.randn(*shape, generator=gen), passes=passes)
    x = torch.randn(rows, shape[1], generator=gen) * torch.linspace(0.01, 30, shape[1])
    best = torch.ops.strata_native.quantized_mm_path()
    product = getattr(torch.ops.strata_native, f"{scheme}_mm")
    weight, scales, n = layer.weight, layer.scales, shape[0]
    outs = [product(x, weight, scales, n, passes, path) for path in range(best + 1)]
    assert all(torch.equal(outs[0], out) for out in outs[1:]), best
    expected = strata_reference(x, layer)  # float32 sums: ~1e-6 of the largest value
    torch.testing.assert_close(outs[0].double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


def _k_quant_weight(n: int, k: int, gen: torch.Generator):
    """Random Q4_K-like codes and scales: ``(codes, scale, zero, k_quant)`` (``Int4Groups``)."""
    codes = torch.randint(0, 16, (n, k), generator=gen)
    d = (
        (torch.rand(n, k // 256, generator=gen) * 0.02 + 1e-3)
        .half()
        .float()
        .repeat_interleave(8, 1)
    )
    d_min = (torch.rand(n, k // 256, generator=gen) * 0.02).half().float().repeat_interleave(8, 1)
    sc, mn = (torch.randint(0, 64, (n, k // GROUP_SIZE), generator=gen).float() for _ in "sm")
    scale = d * sc
    return codes, scale, 8 * scale - d_min * mn, torch.stack((d, -d_min, sc, mn), dim=-1)


@pytest.mark.skipif("not _strata_built()", reason="no native library here")
@pytest.mark.parametrize("shape", [(192, 256), (320, 1536)])
@pytest.mark.parametrize("passes", [1, 2])
def test_strata_int4_keeps_q4_k_scales_as_stored_bitwise_on_every_path(shape, passes):
    """A Q4_K weight's 6-bit scale codes and float16 pairs kept as the file holds them
    (0.625 bits a weight, not 1): the weight is exactly the file's, every instruction path
    gives the same bits, and the product is what the codes and scales make."""
    n, k = shape
    gen = torch.Generator().manual_seed(k)
    codes, scale, zero, k_quant = _k_quant_weight(n, k, gen)
    layer = QuantizedLinear.int4_groups(
        codes, scale, zero, kernel="strata", passes=passes, k_quant=k_quant
    )
    assert layer.scales.dtype == torch.uint8 and layer.scales.numel() == n * k // 256 * 20
    d, neg_d_min, sc, mn = (k_quant[..., i].double().repeat_interleave(32, 1) for i in range(4))
    file_weight = codes.double() * d * sc + neg_d_min * mn  # Q4_K: D sc q - Dmin mn
    assert torch.equal(layer.dequantized(torch.float32), file_weight.float())
    x = torch.randn(40, k, generator=gen) * torch.linspace(0.01, 30, k)  # AMX: 2 blocks of 16
    best = torch.ops.strata_native.quantized_mm_path()
    outs = [
        torch.ops.strata_native.int4_mm(x, layer.weight, layer.scales, n, passes, path)
        for path in range(best + 1)
    ]
    assert all(torch.equal(outs[0], out) for out in outs[1:]), best
    expected = strata_reference(x, layer)
    torch.testing.assert_close(outs[0].double(), expected, rtol=0, atol=1e-5 * expected.abs().max())
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.strata_native.int4_mm(
            x[:, :128], layer.weight[:, :16].contiguous(), layer.scales, n
        )


@pytest.mark.skipif("not _strata_built()", reason="no native library here")
def test_strata_int8_keeps_a_q8_0_weight_as_stored_and_pads_its_rows():
    """A GGUF ``Q8_0`` weight (``d * q`` per group of 32, ``d`` float16, the group's largest
    ``|q|`` 127) comes back from Strata's int8 layout exactly, also where its rows are not a
    multiple of the kernel's tiles of 16; torch's per-row int8 cannot keep it."""
    gen = torch.Generator().manual_seed(5)
    rows, groups = 50, 6
    q = torch.randint(-126, 127, (rows, groups, GROUP_SIZE), generator=gen)
    q[..., 3] = 127 * torch.where(torch.rand(rows, groups, generator=gen) < 0.5, -1, 1)
    d = (torch.rand(rows, groups, 1, generator=gen) * 0.01 + 1e-4).half().float()
    w = (q * d).reshape(rows, groups * GROUP_SIZE)
    layer = QuantizedLinear.int8(w, kernel="strata")
    assert layer.kernel == "strata" and layer.weight.shape == (4, groups * GROUP_SIZE // 4, 64)
    assert torch.equal(layer.dequantized(torch.float32), w)
    x = torch.randn(3, groups * GROUP_SIZE, generator=gen)
    assert layer(x).shape == (3, rows)
    assert not torch.equal(QuantizedLinear.int8(w).dequantized(torch.float32), w)


@pytest.mark.skipif("not _strata_built()", reason="no native library here")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_one_activation_pass_keeps_8_bits_and_two_keep_15(scheme):
    """Against x unquantized (float64), a product's error is within what its passes leave of
    each group: ``max|x| / 254`` per element after one pass, ``max|x| / (254 * 254)`` after two
    (the second pass quantizes the first's remainder, at most half its step), times the
    group's sum of ``|w|``; plus float32 rounding."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(64, 256, generator=gen)
    x = torch.randn(5, 256, generator=gen) * torch.linspace(0.1, 8, 256)
    groups = x.double().reshape(5, -1, GROUP_SIZE)
    errors = {}
    for passes, step in ((1, 254), (2, 254 * 254)):
        layer = _layer(f"{scheme}/strata", w, passes=passes)
        weight = layer.dequantized(torch.float32).double()
        exact = x.double() @ weight.T
        w_sums = weight.abs().reshape(64, -1, GROUP_SIZE).sum(-1)  # [N, G]
        bound = (groups.abs().amax(-1) / step) @ w_sums.T  # [rows, N]
        error = (layer(x).double() - exact).abs()
        assert (error <= bound + 1e-5 * exact.abs().max()).all(), passes
        errors[passes] = error.mean().item()
    assert errors[2] < errors[1] / 50, errors


def test_quantize_model_gives_each_projection_its_passes():
    """Under Strata's products, each projection takes its ``ACTIVATION_PASSES``."""
    from replicas.model import load_model

    if not _strata_built():
        pytest.skip("no native library here")
    model = load_model("tiny", torch.device("cpu")).model
    quantize_model(model, "int4", int4_kernel="strata")
    layer = model.layers[0]
    passes = {
        name: (module.kernel, module.passes)
        for name, module in (
            ("wqkv", layer.attention.wqkv),
            ("wo", layer.attention.wo),
            ("w13", layer.feed_forward.w13),
            ("w2", layer.feed_forward.w2),
            ("output", model.output),
        )
    }
    assert passes == {name: ("strata", n) for name, n in ACTIVATION_PASSES.items()}
    with pytest.raises(ValueError, match="passes must be 1 or 2"):
        QuantizedLinear.int4(torch.randn(64, 64), kernel="strata", passes=3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_int4_of_a_float_weight_is_within_half_a_step(kernel):
    w = torch.randn(64, 128)
    layer = QuantizedLinear.int4(w, kernel=kernel)
    groups = w.reshape(64, -1, GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (layer.dequantized(torch.float32) - w).reshape(64, -1, GROUP_SIZE).abs()
    assert (error <= step[..., None] * 0.56).all()


def test_int4_rejects_shapes_the_kernel_does_not_take():
    with pytest.raises(ValueError, match="multiple of 64"):
        QuantizedLinear.int4(torch.randn(100, 64))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 3, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_matches_the_dequantized_weight(scheme, rows, with_bias):
    """The packed kernels (CPU) and the dense path (what CUDA runs) both give the product with
    the dequantized weight; Strata's kernels give it with x quantized as they quantize it."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 256, generator=gen)
    bias = torch.randn(192, generator=gen) if with_bias else None
    layer = _layer(scheme, w, bias)
    x = torch.randn(rows, 256, generator=gen)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 192)
    expected = reference(x, layer.dequantized(torch.float32), layer.bias)
    if scheme.endswith("/strata"):
        exact = strata_reference(x, layer)
        torch.testing.assert_close(y.double(), exact, rtol=0, atol=1e-5 * exact.abs().max())
        # Against x unquantized: two int8 passes leave each x within max|x| / 254^2 of what
        # the kernel multiplies, so each product within that times its group's sum of |w|,
        # plus the bfloat16 rounding of x that the reference does.
        torch.testing.assert_close(y, expected, rtol=1e-2, atol=0.15)
    else:
        # bfloat16 output rounding (2^-8 relative) on values of magnitude ~ sqrt(256) * |w|.
        torch.testing.assert_close(y, expected, rtol=1e-2, atol=0.15)
    y3 = layer(x.reshape(1, rows, 256))
    assert y3.shape == (1, rows, 192)


# ---- GGUF 4-bit codes ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_codes_equal_gguf_dequantization(kind, tmp_path):
    """A Q4 tensor written by gguf-py's quantizer, read back as codes: dequantizing the codes
    equals gguf-py's own dequantization of the file's bytes."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    from replicas.model.gguf import int4_groups_of_tensor

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((64, 96)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    writer.add_tensor("w", quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors[0]
    codes, scale, zero = int4_groups_of_tensor(tensor)[:3]
    assert codes.shape == (64, 96) and int(codes.max()) <= 15
    ours = (codes.double() - 8).reshape(64, -1, GROUP_SIZE) * scale.double()[..., None]
    ours = (ours + zero.double()[..., None]).reshape(64, 96)
    expected = torch.from_numpy(dequantize(np.asarray(tensor.data), qtype).astype(np.float64))
    torch.testing.assert_close(ours, expected.reshape(64, 96), rtol=0, atol=1e-6)
    if _strata_built():  # Strata's layout keeps d and m as the file's float16 values
        layer = QuantizedLinear.int4_groups(codes, scale, zero, kernel="strata")
        strata = layer.dequantized(torch.float64)
        torch.testing.assert_close(strata, expected.reshape(64, 96), rtol=0, atol=1e-6)


# ---- whole models -------------------------------------------------------------------------


def _tiny(scheme: str):
    from replicas.model import load_model

    loaded = load_model("tiny", torch.device("cpu"), quantization=scheme)
    assert loaded.quantization == scheme
    return loaded


def test_quantize_model_replaces_every_linear_and_keeps_the_embedding():
    from replicas.model import load_model

    loaded = load_model("tiny", torch.device("cpu"))
    embedding = loaded.model.tok_embeddings.weight.clone()
    quantize_model(loaded.model, "int8")
    assert not any(isinstance(m, nn.Linear) for m in loaded.model.modules())
    assert torch.equal(loaded.model.tok_embeddings.weight, embedding)
    with pytest.raises(ValueError, match="int8 or int4"):
        quantize_model(loaded.model, "int2")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_logits_stay_close_to_float32(scheme, make_batch, chunk):
    from replicas.model import load_model

    dense = load_model("tiny", torch.device("cpu"))
    quantized = _tiny(scheme)
    tokens = list(range(3, 70))
    outs = []
    for loaded in (dense, quantized):
        specs = loaded.model.kv_cache_specs(torch.float32)
        tables = {g: list(range(5)) for g in specs}
        caches = {g: torch.zeros(s.shape(5, 16)) for g, s in specs.items()}
        batch = make_batch([chunk(tokens, 0, len(tokens), tables)], 16)
        with torch.no_grad():
            outs.append(loaded.model.compute_logits(loaded.model(batch, caches)))
    expected, got = outs
    # Same most likely token almost everywhere, logits within a few percent of their spread.
    agree = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    assert (got - expected).abs().mean() < 0.1 * expected.std()


def test_unknown_quantization_is_rejected_naming_the_choices():
    from replicas.model import load_model

    with pytest.raises(ValueError, match="quantization must be auto, none, int8 or int4"):
        load_model("tiny", torch.device("cpu"), quantization="fp8")


def test_auto_keeps_a_float_checkpoint_as_loaded():
    assert _tiny_auto().quantization == "none"


def _tiny_auto():
    from replicas.model import load_model

    return load_model("tiny", torch.device("cpu"), quantization="auto")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_rows_product_is_bitwise_the_same_in_any_batch(scheme):
    """Prefix caching, chunked prefill and batching change how many rows a product has; they
    must not change a row's result, or caching would change greedy outputs."""
    gen = torch.Generator().manual_seed(7)
    layer = _layer(scheme, torch.randn(192, 128, generator=gen))
    x = torch.randn(300, 128, generator=gen)
    whole = layer(x)
    for start, stop in ((0, 1), (5, 6), (0, 12), (17, 80), (100, 300)):
        assert torch.equal(layer(x[start:stop]), whole[start:stop]), (start, stop)


@pytest.mark.parametrize(
    "variant",
    [{"attention_bias": True}, {"qk_norm": True}, {"tie_word_embeddings": True}],
    ids=["qkv-bias", "qk-norm", "tied"],
)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_fused_projections_keep_biases_norms_and_ties(variant, scheme, make_batch, chunk):
    """Fusing q/k/v (with Qwen2's biases or Qwen3's q/k norms) and gate/up keeps the float
    model's logits, up to the quantization of its weights."""
    from dataclasses import replace

    from replicas.model.builtin import BUILTIN_MODEL_ARGS, init_random_weights
    from replicas.model.registry import build_model

    args = replace(BUILTIN_MODEL_ARGS["tiny"](), **variant)
    dense = build_model(args)
    init_random_weights(dense, seed=3)
    dense.eval()
    fused = copy.deepcopy(dense)
    quantize_model(fused, scheme)
    tokens = list(range(5, 45))
    outs = []
    for model in (dense, fused):
        specs = model.kv_cache_specs(torch.float32)
        caches = {g: torch.zeros(s.shape(3, 16)) for g, s in specs.items()}
        batch = make_batch([chunk(tokens, 0, len(tokens), {g: [0, 1, 2] for g in specs})], 16)
        with torch.no_grad():
            outs.append(model.compute_logits(model(batch, caches)))
    expected, got = outs
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
    assert (got - expected).abs().mean() < 0.1 * expected.std()


@pytest.mark.parametrize("scheme", ["int8", "int4", "strata-int8", "strata-int4"])
def test_quantizing_a_few_rows_at_a_time_gives_the_same_layer(scheme, monkeypatch):
    """Rows are quantized a chunk at a time (a few MiB of float), and a fused projection's
    weights one after the other; every scale is a row's or a row group's own, so the layer is
    the one quantized whole."""
    from replicas.model import quant

    if scheme.startswith("strata") and not _strata_built():
        pytest.skip("no native library here")
    kernel = "strata" if scheme.startswith("strata") else "torch"
    make = QuantizedLinear.int8 if scheme.endswith("int8") else QuantizedLinear.int4
    weight = torch.randn(320, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    whole = make(weight, kernel=kernel)
    monkeypatch.setattr(quant, "_CHUNK_ROWS", 64)
    chunked = make(weight, kernel=kernel)
    assert torch.equal(whole.weight, chunked.weight) and torch.equal(whole.scales, chunked.scales)
    x = torch.randn(3, 96)
    assert torch.equal(whole(x), chunked(x))
    parts = make([weight[:128], weight[128:]], kernel=kernel)  # a fused projection's weights
    assert torch.equal(whole.weight, parts.weight) and torch.equal(whole.scales, parts.scales)
