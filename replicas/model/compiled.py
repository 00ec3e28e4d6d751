"""The decoder stack through ``torch.compile`` (inductor), with attention left to eager torch.

A decode step of a small model is a few hundred small ops per layer (norms, rotary, residual
adds, activation, casts), each paying dispatch and an output allocation. Inductor fuses them into
a few C++ loops per layer; the products (packed int4/int8 kernels, dense GEMMs) stay library
calls. Attention over the block cache stays eager: its host-side metadata (``AttentionMetadata``:
groups, chunks, masks) differs at every step, so the compiled graph sees it as one opaque op,
``strata::cached_attention``, that reads the forward's metadata from a thread-local slot set
around the compiled call (``attention_metadata``).

The token dimension is dynamic (``backed_size_oblivious``: not specialized at 1 where torch can
avoid it), so a batch of decodes and prefill chunks of any length share one graph; a forward of
a single token gets a second (a stride computation in torch specializes 1). Both compute each
row alone as eager does, and prefix caching gives the outputs it gives without compile
(``tests/unit/model/test_compiled.py``). Compiling takes tens of seconds on a
small CPU, so it is asked for (``torch_compile``), not measured by ``auto``
(``replicas.model.autotune`` times each candidate in a fraction of a second); the benchmark
``engine-vs-llamacpp --torch-compile`` measures what it gives. Where compiling or a compiled
forward fails, the model logs why and runs eager from then on.

Rounding: in float32 the compiled stack gives eager's greedy outputs (tested). In bfloat16 it
cannot promise them: a fused chain of ops (rotary, norm, activation) computes in float32 and
rounds once where eager rounds after each op, and a fused reduction sums in another order
(``emulate_precision_casts`` rounds explicit casts as eager does, not every intermediate), so
a near-tied greedy token can go the other way. Keeping the norm out of the graph (an opaque op)
made SmolLM2's bfloat16 tokens equal eager's on the prompts tried but cost the gain
(benchmarks/README.md, ``engine-vs-llamacpp``), and the tiny test model's still differed. Hence
opt-in, and off by default.
"""

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from replicas.model.attention import AttentionMetadata, cached_attention

logger = logging.getLogger(__name__)

_local = threading.local()


@contextmanager
def attention_metadata(metas: dict[str, AttentionMetadata]) -> Iterator[None]:
    """Makes ``metas`` (by cache group) what ``strata::cached_attention`` reads on this thread."""
    previous = getattr(_local, "metas", None)
    _local.metas = metas
    try:
        yield
    finally:
        _local.metas = previous


@torch.library.custom_op("strata::cached_attention", mutates_args=("kv_cache",))
def cached_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    group: str,
) -> torch.Tensor:
    """``cached_attention`` with the metadata of the forward in flight on this thread."""
    return cached_attention(q, k, v, kv_cache, layer, _local.metas[group])


@cached_attention_op.register_fake
def _(q, k, v, kv_cache, layer, group):
    return torch.empty_like(q)


def run_layers(
    layers: nn.ModuleList,
    norm: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: dict[str, torch.Tensor],
    metas: dict[str, AttentionMetadata] | None,
) -> torch.Tensor:
    """The decoder layers then the final norm, eager; ``metas`` None: attention through
    ``strata::cached_attention`` (inside a compiled graph)."""
    for layer in layers:
        group = layer.attention.group
        x = layer(x, cos, sin, kv_caches[group], None if metas is None else metas[group])
    return norm(x)


class CompiledLayers:
    """``layers`` then ``norm`` over hidden states, compiled on first use (see the module
    docstring); falls back to eager for good if compiling or running the graph fails."""

    def __init__(self, layers: nn.ModuleList, norm: nn.Module) -> None:
        self.layers, self.norm = layers, norm
        self.failed: str | None = None
        self._compiled: Callable | None = None

    def eager(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: dict[str, torch.Tensor],
        metas: dict[str, AttentionMetadata] | None,
    ) -> torch.Tensor:
        return run_layers(self.layers, self.norm, x, cos, sin, kv_caches, metas)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: dict[str, torch.Tensor],
        metas: dict[str, AttentionMetadata],
    ) -> torch.Tensor:
        if self.failed is not None:
            return self.eager(x, cos, sin, kv_caches, metas)
        if self._compiled is None:
            _cache_dir_per_cpu_capability()
            self._compiled = torch.compile(self.eager, fullgraph=True)
        for tensor in (x, cos, sin):
            torch._dynamo.mark_dynamic(tensor, 0)  # the token count; every other size is fixed
        try:
            with attention_metadata(metas), _compile_settings():
                return self._compiled(x, cos, sin, kv_caches, None)
        except Exception as error:  # compiling can fail in many ways; each one means eager
            self.failed = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            logger.warning("compile: the model runs eager (compiling failed: %s)", self.failed)
            return self.eager(x, cos, sin, kv_caches, metas)


@contextmanager
def _compile_settings() -> Iterator[None]:
    """The token count symbolic even at 1 where torch allows; intermediates rounded as in eager.
    (Inductor is imported here, not with the model: it takes a second or more to import.)"""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    with (
        fx_config.patch(backed_size_oblivious=True),
        inductor_config.patch(emulate_precision_casts=True),
    ):
        yield


CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def _cache_dir_per_cpu_capability() -> None:
    """Inductor's on-disk cache, unless the user named one, in a directory of torch's CPU
    capability: its keys do not include the vector ISA the kernels were built for, so kernels
    built under one capability (``ATEN_CPU_CAPABILITY``, or a cache directory that outlives a
    move to another CPU) were loaded under another and gave garbage or crashed (measured:
    AVX-512 kernels under ``ATEN_CPU_CAPABILITY=avx2``: every token 0; the reverse: a crash)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    if os.environ.get(CACHE_DIR_ENV, default) != default:  # importing inductor sets the default
        return
    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ[CACHE_DIR_ENV] = os.path.join(default, f"strata-{capability}")
