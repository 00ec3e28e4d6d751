"""Builds a model from a checkpoint's weights one tensor at a time, straight into the dtype and
quantization it will run in, so that start-up never holds the model twice or in float32.

A model is built module by module on the meta device: each module's parameters are made on the
target device in the target dtype and read from the checkpoint (``Weights``: a GGUF file's,
``replicas.model.gguf_weights``, or a safetensors directory's, ``replicas.model.hf``), each
tensor dequantized a slice of rows at a time and cast as it is copied; a decoder layer is then
quantized at once (``replicas.model.quantize.quantize_layer``), before the next is read, so its
float weights are freed; a weight an int4 product takes as its stored codes (a ``Q4_0``,
``Q4_1`` or ``Q4_K`` tensor) is never dequantized. What this builds is what loading the whole
model in float32, casting it and quantizing it builds: the same casts and the same quantization
of the same values, bit for bit (``tests/unit/model/test_streamed.py``).

A *probe* is the same model with only some of its decoder layers (``probe_layers``), which
``auto`` times instead of the whole model (``replicas.model.autotune``): every candidate shares
the model's structure, and a layer costs the same in a probe as in the whole model.
"""

import contextlib
import ctypes
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from replicas.dtypes import torch_dtype
from replicas.model.autotune import Candidate
from replicas.model.config import ModelArgs
from replicas.model.quantize import (
    StoredCodes,
    quantize_layer,
    quantize_output,
    stored_int4_weights,
)
from replicas.model.registry import build_model
from replicas.model.transformer import Transformer

MIN_PROBE_LAYERS = 2
PROBE_MIN_WEIGHTS = 1 << 25
"""A probe's layers hold at least this many weights (32 Mi): its timings are priced at the
model's depth (``autotune.at_depth``), which multiplies the noise of the layers' share of its
time, so that share must be long beside a timer's resolution and a shared VM's jitter. (A
probe's forwards skip the LM head, timed once on its own; before, its layers had to hold twice
the head's weights, or the head took most of its time.)"""


RELEASE_EVERY = 4
"""Quantized layers between two ``release_freed_memory`` calls while a model is built: the
freed float weights of every layer would otherwise stay in the heap until the end and raise the
peak, while releasing after every layer costs page faults as the next layer takes the pages
back (figures in benchmarks/README.md)."""


class Weights(Protocol):
    """A checkpoint's weights by our parameter names, read when asked for."""

    stored_bits: dict[str, int]  # bits per weight as stored (empty: a float checkpoint)
    files: list[str]  # what they are read from (the choice cache's key)

    @property
    def is_quantized(self) -> bool: ...

    def copy_into(self, name: str, target: torch.Tensor) -> None: ...

    def int4_groups(self, name: str) -> StoredCodes | None: ...


class KeptFloat:
    """``weights`` with the tensors ``names`` kept in float32 once read: ``auto`` builds a probe
    for each candidate, and a large vocabulary's embedding can take longer to read than the
    rest of a probe to build. A kept tensor is cast from its float32 values,
    as it would be read."""

    def __init__(self, weights: Weights, names: Sequence[str]) -> None:
        self._weights, self._names = weights, set(names)
        self._kept: dict[str, torch.Tensor] = {}
        self.stored_bits, self.files = weights.stored_bits, weights.files
        self.heads: dict[tuple[str, str], nn.Module] = {}  # by (scheme, kernel): _quantize_head

    @property
    def is_quantized(self) -> bool:
        return self._weights.is_quantized

    def copy_into(self, name: str, target: torch.Tensor) -> None:
        if name not in self._names:
            self._weights.copy_into(name, target)
            return
        if name not in self._kept and target.dtype == torch.float32:
            self._weights.copy_into(name, target)  # kept as read: no second copy
            self._kept[name] = target.detach()
            return
        if name not in self._kept:
            values = torch.empty(target.shape, dtype=torch.float32, device=target.device)
            self._weights.copy_into(name, values)
            self._kept[name] = values
        with torch.no_grad():
            target.copy_(self._kept[name])

    def int4_groups(self, name: str) -> StoredCodes | None:
        return self._weights.int4_groups(name)

    def shared(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The kept float32 tensor itself, for a float32 parameter ``name`` once it has been
        read (a float32 probe's embedding is the kept one, not a second copy), else None."""
        return self._kept.get(name) if dtype == torch.float32 else None


def build_streamed(
    args: ModelArgs,
    weights: Weights,
    candidate: Candidate,
    device: torch.device,
    layers: Sequence[int] | None = None,
) -> Transformer:
    """The model of ``args`` in ``candidate``'s dtype and quantization, in eval mode with
    gradients off, read from ``weights`` a tensor at a time; ``layers``: only these of its
    decoder layers (a probe), in this order."""
    layers = list(range(args.num_layers)) if layers is None else list(layers)
    if layers != list(range(args.num_layers)):
        types = tuple(args.layer_types[i] for i in layers)
        args = replace(args, num_layers=len(layers), layer_types=types)
    with torch.device("meta"):
        net = build_model(args)
    net.to(dtype=torch_dtype(candidate.dtype))
    scheme, kernel = candidate.quantization, candidate.kernel
    _read(net.tok_embeddings, "tok_embeddings", weights, device)
    for built, (layer, index) in enumerate(zip(net.layers, layers, strict=True), 1):
        prefix = f"layers.{index}"
        names = [f"{prefix}.{n}" for n, _ in layer.named_parameters()]
        groups = _int4_groups(weights, names) if scheme == "int4" else {}
        # weights an int4 product takes as stored codes are never dequantized
        codes_only = stored_int4_weights(layer, prefix, groups, weights.stored_bits, kernel)
        _read(layer, prefix, weights, device, codes_only)
        if scheme != "none":
            quantize_layer(layer, prefix, scheme, groups, weights.stored_bits, kernel)
            if built % RELEASE_EVERY == 0:
                release_freed_memory()  # the layers' float weights and temporaries
    _read(net.norm, "norm", weights, device)
    if args.tie_word_embeddings:
        net.tie_weights()
    else:
        _read(net.output, "output", weights, device)
    if scheme != "none":
        _quantize_head(net, weights, scheme, kernel)
    net.eval()
    net.requires_grad_(False)
    return net


def _quantize_head(net: Transformer, weights: Weights, scheme: str, kernel: str) -> None:
    """``quantize_output`` on ``net``; a head in one of Strata's layouts of a file's stored
    codes and scales (no float value enters it, so it is the same in every dtype) is kept by
    ``weights`` where it keeps heads (``KeptFloat``): ``auto`` builds a probe per candidate,
    and reading and packing a large vocabulary's head again for each took a second a build."""
    heads = getattr(weights, "heads", None)
    key = (scheme, kernel)
    if heads is not None and key in heads:
        net.output = heads[key]
        return
    name = "tok_embeddings" if net.args.tie_word_embeddings else "output"
    groups = _int4_groups(weights, [f"{name}.weight"]) if scheme == "int4" else None
    quantize_output(net, scheme, groups, weights.stored_bits, kernel)
    # Strata's layouts with uint8 scales hold stored codes only (K-quant int4, Q6_K)
    head = net.output
    if heads is not None and head.kernel == "strata" and head.scales.dtype == torch.uint8:
        heads[key] = head


def release_freed_memory() -> None:
    """Hands the C heap's free pages back to the system (glibc's ``malloc_trim``): a build's
    temporaries of a few MiB each are freed into the heap, not to the system, and would stay in
    the process's resident memory beside the model."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _read(
    module: nn.Module,
    prefix: str,
    weights: Weights,
    device: torch.device,
    unread: set[str] | frozenset[str] = frozenset(),
) -> None:
    """``module``'s parameters made on ``device`` (in the dtype they have) and read, but for
    those named in ``unread`` (left as allocated)."""
    module.to_empty(device=device)
    shared = getattr(weights, "shared", lambda *_: None)
    for name, param in module.named_parameters():
        if f"{prefix}.{name}" in unread:
            continue
        kept = shared(f"{prefix}.{name}", param.dtype)
        if kept is not None and kept.device == param.device:
            param.data = kept  # nothing computes in place on a weight
        else:
            weights.copy_into(f"{prefix}.{name}", param)


def _int4_groups(weights: Weights, names: list[str]) -> dict[str, StoredCodes]:
    """The stored int4 codes of the weights ``names`` that have them."""
    groups = {name: weights.int4_groups(name) for name in names}
    return {name: g for name, g in groups.items() if g is not None}


def probe_size(args: ModelArgs) -> int:
    """How many decoder layers a probe of the model of ``args`` has (``PROBE_MIN_WEIGHTS``)."""
    with torch.device("meta"):
        layer = build_model(replace(args, num_layers=1, layer_types=args.layer_types[:1]))
    per_layer = sum(p.numel() for p in layer.layers[0].parameters())
    wanted = math.ceil(PROBE_MIN_WEIGHTS / per_layer)
    return min(args.num_layers, max(MIN_PROBE_LAYERS, wanted))


def probe_layers(
    args: ModelArgs, stored_bits: dict[str, int], count: int | None = None
) -> list[int]:
    """``count`` decoder layers (``probe_size`` where None) that stand for the whole model:
    layers are of one kind where their attention type and every weight's stored bits agree (a
    K-quant mix keeps some layers' ``attn_v`` and ``ffn_down`` at 6 bits), and each kind gets
    its share of the probe, the largest shares first (the first layers of each kind)."""
    count = probe_size(args) if count is None else count
    if count >= args.num_layers:
        return list(range(args.num_layers))
    kinds: dict[tuple, list[int]] = {}
    for i, attention in enumerate(args.layer_types):
        prefix = f"layers.{i}."
        bits = sorted((n[len(prefix) :], b) for n, b in stored_bits.items() if n.startswith(prefix))
        kinds.setdefault((attention, *bits), []).append(i)
    members = sorted(kinds.values(), key=len, reverse=True)
    quotas = [count * len(m) / args.num_layers for m in members]
    taken = [int(q) for q in quotas]
    by_remainder = sorted(range(len(members)), key=lambda k: quotas[k] - taken[k], reverse=True)
    for k in by_remainder[: count - sum(taken)]:
        taken[k] += 1
    return sorted(i for m, t in zip(members, taken, strict=True) for i in m[:t])
