"""A model's linear layers replaced by ``QuantizedLinear`` products (``replicas.model.quant``):
q/k/v and gate/up fused into one product each, every weight under the scheme asked for, but
kept at int8 where its file stored it at more than 4 bits or the int4 kernel does not take its
shape, and built from a GGUF file's stored int4 codes where it has them (and from its
``Q6_K`` or ``Q3_K`` weights' fields, 6 bits rather than int8's 8, and its ``Q2_K`` weights as
stored, 2.625 bits, under Strata's kernels, where a fused product's weights differ in layout
each in its own: ``replicas.model.mixed``)."""

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import nn

from replicas.model.mixed import MixedLinear
from replicas.model.quant import (
    ACTIVATION_PASSES,
    QUANTIZATIONS,
    Int4Groups,
    QuantizedLinear,
    _shape,
    int4_fits,
)
from replicas.model.six_bit import SixBitRows
from replicas.model.two_bit import TwoBitRows

StoredCodes = Int4Groups | SixBitRows | TwoBitRows
"""A weight's codes as its file stores them: int4 groups, the 6-bit layout's fields, or a
``Q2_K`` weight's rows for the 2-bit layout."""


def quantize_model(
    model: nn.Module,
    scheme: str,
    int4_groups: Mapping[str, StoredCodes] | None = None,
    stored_bits: Mapping[str, int] | None = None,
    int4_kernel: str = "torch",
) -> None:
    """Replaces every linear layer of a ``Transformer`` by a ``QuantizedLinear`` of ``scheme``,
    in place, fusing q/k/v and gate/up into one product each (fewer kernel calls per layer; a
    ``MixedLinear`` where the fused weights keep different stored layouts).

    ``int4_groups``: stored int4 codes by parameter name (a GGUF file's Q4 tensors), used as
    they are under ``int4``. ``stored_bits``: bits per weight as stored; under ``int4`` a weight
    stored at 5 bits or more is kept at int8 rather than lose the precision its file kept, and
    so is one whose shape the int4 kernel does not take (``int4_fits``). ``int4_kernel``:
    ``torch`` or ``strata``: under ``int4``, the product of the int4 weights and of the int8
    ones kept beside them (a GGUF file's ``Q8_0`` LM head); where a weight does not fit Strata's
    layout, torch's.
    """
    for i, layer in enumerate(model.layers):
        quantize_layer(layer, f"layers.{i}", scheme, int4_groups, stored_bits, int4_kernel)
    quantize_output(model, scheme, int4_groups, stored_bits, int4_kernel)


def quantize_layer(
    layer: nn.Module,
    prefix: str,
    scheme: str,
    int4_groups: Mapping[str, StoredCodes] | None = None,
    stored_bits: Mapping[str, int] | None = None,
    int4_kernel: str = "torch",
) -> None:
    """``quantize_model`` on one decoder layer, whose parameters are named ``prefix.*`` in
    ``int4_groups`` and ``stored_bits`` (a model built a layer at a time quantizes each layer
    as it is read)."""
    quantized = _quantizer(scheme, int4_groups, stored_bits, int4_kernel)
    with torch.no_grad():
        for module_name, fused, parts in LAYER_PRODUCTS:
            module = getattr(layer, module_name)
            names = [f"{prefix}.{module_name}.{part}" for part in parts]
            linears = [getattr(module, part) for part in parts]
            setattr(module, fused, quantized(names, linears, ACTIVATION_PASSES[fused]))
            for part in parts:
                if part != fused:
                    delattr(module, part)


LAYER_PRODUCTS = (
    ("attention", "wqkv", ("wq", "wk", "wv")),
    ("attention", "wo", ("wo",)),
    ("feed_forward", "w13", ("w1", "w3")),
    ("feed_forward", "w2", ("w2",)),
)
"""A decoder layer's products once quantized: (module, fused product, the linear layers whose
rows it holds one after the other)."""


def stored_int4_weights(
    layer: nn.Module,
    prefix: str,
    int4_groups: Mapping[str, StoredCodes],
    stored_bits: Mapping[str, int] | None = None,
    int4_kernel: str = "torch",
) -> set[str]:
    """The weights of a decoder layer (``prefix.*``) that ``quantize_layer`` under ``int4``
    builds from their stored codes in ``int4_groups``, not from their float values: a model
    built a layer at a time need not read (dequantize) them."""
    kept = set()
    strata = int4_kernel == "strata"
    bits = stored_bits or {}
    for module_name, _, parts in LAYER_PRODUCTS:
        module = getattr(layer, module_name)
        names = [f"{prefix}.{module_name}.{part}" for part in parts]
        weight = [getattr(module, part).weight for part in parts]
        if _uses_stored_codes("int4", names, weight, int4_groups, bits, strata) or (
            strata and _stored_fields(names, int4_groups) is not None
        ):
            kept.update(f"{name}.weight" for name in names)
        elif strata and _product_scheme("int4", names, weight, bits) != "int4":
            kept.update(f"{n}.weight" for n in _mixed_parts(names, weight, int4_groups, bits))
    return kept


def _uses_stored_codes(
    scheme: str,
    names: list[str],
    weight: list[torch.Tensor],
    groups: Mapping[str, StoredCodes],
    bits: Mapping[str, int],
    strata: bool = False,
) -> bool:
    """Whether the product of linear layers ``names`` is int4 made from their stored codes:
    4-bit codes, or under Strata's kernels (``strata``) 5-bit ones too (a GGUF ``Q5_K``,
    ``Q5_0`` or ``Q5_1`` weight's, which its int4 product takes with a fifth bit plane) and
    IQ4's level indices (all of the product's weights IQ4's, or none)."""
    stored = [groups.get(f"{n}.weight") for n in names]
    if not all(isinstance(s, Int4Groups) for s in stored):
        return False
    if len({s.levels for s in stored}) > 1:  # IQ4's levels beside plain codes: int8
        return False
    if (
        strata
        and scheme == "int4"
        and (stored[0].levels or all(bits.get(f"{n}.weight", 16) <= 5 for n in names))
    ):
        return int4_fits(*_shape(weight))
    return _product_scheme(scheme, names, weight, bits) == "int4"


def _mixed_parts(
    names: list[str],
    weight: list[torch.Tensor],
    groups: Mapping[str, StoredCodes],
    bits: Mapping[str, int],
) -> list[str]:
    """The weights of a product of several (``names``, under ``int4`` with Strata's kernels)
    that keep a stored layout each when the product as a whole has none: a ``MixedLinear`` of
    their products then serves it (else int8 from their float values); empty where none does
    or where a part's rows, but the last's, are no multiple of the kernels' tiles of 16."""
    if len(names) < 2 or any(w.shape[0] % 16 for w in weight[:-1]):
        return []
    return [
        n
        for n, w in zip(names, weight)
        if _uses_stored_codes("int4", [n], [w], groups, bits, True)
        or _stored_fields([n], groups) is not None
    ]


def _stored_fields(names: list[str], groups: Mapping[str, StoredCodes]) -> list | None:
    """Every weight of the product of ``names`` as its file stores it, where they all have one
    layout of Strata's library and it is built here: the 6-bit fields (``Q6_K``, ``Q3_K``) or
    the 2-bit layout's rows (``Q2_K``); else None."""
    from replicas.model import native_stack

    stored = [groups.get(f"{n}.weight") for n in names]
    for layout in (SixBitRows, TwoBitRows):
        if all(isinstance(s, layout) for s in stored):
            return None if native_stack.load_error() else stored
    return None


def _product_scheme(
    scheme: str, names: list[str], weight: list[torch.Tensor], bits: Mapping[str, int]
) -> str:
    """``scheme``, or int8 for a product whose weights are stored at more than 4 bits or that
    the int4 kernel does not take (``quantize_model``)."""
    if scheme == "int4" and all(bits.get(f"{n}.weight", 16) <= 4 for n in names):
        return "int4" if int4_fits(*_shape(weight)) else "int8"
    return "int8"


def quantize_output(
    model: nn.Module,
    scheme: str,
    int4_groups: Mapping[str, StoredCodes] | None = None,
    stored_bits: Mapping[str, int] | None = None,
    int4_kernel: str = "torch",
) -> None:
    """``quantize_model`` on the LM head; a tied head is the embedding matrix as stored."""
    groups = dict(int4_groups or {})
    bits = dict(stored_bits or {})
    if model.args.tie_word_embeddings:
        for stored in (groups, bits):
            if "tok_embeddings.weight" in stored:
                stored["output.weight"] = stored["tok_embeddings.weight"]
    quantized = _quantizer(scheme, groups, bits, int4_kernel)
    with torch.no_grad():
        model.output = quantized(["output"], [model.output], ACTIVATION_PASSES["output"])


def _quantizer(
    scheme: str,
    int4_groups: Mapping[str, StoredCodes] | None,
    stored_bits: Mapping[str, int] | None,
    int4_kernel: str,
) -> Callable[[list[str], list[nn.Linear], int], QuantizedLinear | MixedLinear]:
    """The function that makes one ``QuantizedLinear`` (or ``MixedLinear``) of linear layers
    named ``names`` (concatenated by rows), following ``quantize_model``'s rules."""
    if scheme not in QUANTIZATIONS or scheme == "none":
        raise ValueError(f"quantization scheme must be int8 or int4, got {scheme!r}")
    # Strata's products for the int4 weights and the int8 ones kept beside them; None: where
    # a weight fits them
    kernel = None if int4_kernel == "strata" and scheme == "int4" else "torch"
    rule = _Rule(scheme, kernel, int4_groups or {}, stored_bits or {})
    return lambda names, linears, passes: _quantized(rule, names, linears, passes)


class _Rule(NamedTuple):
    """What ``_quantized`` follows: the scheme, Strata's kernels (``kernel`` None) or torch's,
    the stored codes and the stored bits by parameter name."""

    scheme: str
    kernel: str | None
    groups: Mapping[str, StoredCodes]
    bits: Mapping[str, int]


def _quantized(
    rule: _Rule, names: list[str], linears: list[nn.Linear], passes: int
) -> QuantizedLinear | MixedLinear:
    """One product of linear layers ``names`` (concatenated by rows) under ``rule``. A module
    function, not a closure calling itself: such a closure is a reference cycle that would keep
    a layer's stored codes alive until the garbage collector runs."""
    scheme, kernel, groups, bits = rule
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    weight = [x.weight for x in linears]  # fused by rows as they are quantized
    if _uses_stored_codes(scheme, names, weight, groups, bits, kernel is None):
        stored = [groups[f"{n}.weight"] for n in names]
        codes, scale, zero = (torch.cat(parts) for parts in list(zip(*stored))[:3])
        k_quant = [s.k_quant for s in stored]
        return QuantizedLinear.int4_groups(
            codes,
            scale,
            zero,
            bias=bias,
            kernel=kernel,
            passes=passes,
            k_quant=torch.cat(k_quant) if None not in k_quant else None,
            levels=stored[0].levels,
        )
    if _product_scheme(scheme, names, weight, bits) == "int4":
        return QuantizedLinear.int4(weight, bias, kernel, passes)
    fields = _stored_fields(names, groups) if kernel is None else None
    if fields is not None and isinstance(fields[0], TwoBitRows):  # Q2_K's: 2.625 bits
        return QuantizedLinear.two_bit(fields, bias, passes)
    if fields is not None:  # Q6_K or Q3_K values exactly: 6.5625 bits, not int8's 8.5
        return QuantizedLinear.six_bit(fields, bias, passes)
    if kernel is None and _mixed_parts(names, weight, groups, bits):
        parts = [_quantized(rule, [n], [x], passes) for n, x in zip(names, linears)]
        if MixedLinear.fits(parts):  # each weight in its own layout
            return MixedLinear(parts)
        # Strata's kernels cannot take one of them: int8 of the parts' own values
        weight = [p.dequantized(torch.float32) for p in parts]
    return QuantizedLinear.int8(weight, bias, kernel, passes)
