"""STRATA_FAKE_CUDA: the CUDA code path run on a CPU-only machine, with a GPU's device checks.

With ``STRATA_FAKE_CUDA=1``, an engine asked for ``device="cuda"`` (``LLM(..., device="cuda")``,
``strata serve --device cuda``) calls ``activate()`` (from ``replicas.engine.engine.
resolve_device``). From then on, in the whole process:

- tensors made for ``cuda`` (``torch.tensor/zeros/empty/arange/full/randn/...(device=...)``,
  ``.to(device)``, ``.cuda()``, ``nn.Module.to``) are CPU tensors that report ``cuda:0``
  (``replicas.fake_cuda.tensor.FakeCudaTensor``): their values are computed for real, and a call
  that mixes them with CPU tensors raises where a GPU raises;
- ``torch.Generator(device="cuda")`` is a CPU generator that reports ``cuda``, so a seeded
  request draws what it draws on the CPU;
- ``torch.cuda`` says one device exists (``is_available()``), with streams and events that are
  always complete and the host's memory (``replicas.fake_cuda.runtime``);
- ``pin_memory`` is ignored (no pinned allocator without CUDA).

Code that only a real GPU can run (Triton kernels, CUDA graphs) checks ``is_active()`` and
takes its other path. ``deactivate()`` undoes the patches (tests).
"""

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from replicas.fake_cuda import runtime
from replicas.fake_cuda.tensor import (
    CUDA,
    FakeCudaTensor,
    check_generator,
    is_cuda_device,
    run_on,
    to,
)

ENV = "STRATA_FAKE_CUDA"

_FACTORIES = (
    "tensor", "as_tensor", "asarray", "scalar_tensor", "zeros", "ones", "empty", "full",
    "empty_strided", "arange", "linspace", "logspace", "eye", "rand", "randn", "randint",
    "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
    "randn_like", "randint_like", "tril_indices", "triu_indices",
)  # fmt: skip
_NEW_METHODS = ("new_tensor", "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided")

__all__ = [
    "ENV",
    "FakeCudaTensor",
    "activate",
    "activated",
    "check_generator",
    "deactivate",
    "is_active",
    "is_requested",
]

_lock = threading.Lock()
_saved: list[tuple[object, str, object]] = []  # (owner, name, original), to undo activate()


def is_requested() -> bool:
    """Whether ``STRATA_FAKE_CUDA=1`` asks for the fake device."""
    return os.environ.get(ENV, "") == "1"


def is_active() -> bool:
    """Whether ``cuda`` is the fake device in this process (then a ``cuda`` path that only a
    real GPU can run, a Triton kernel or a CUDA graph, must take its other path)."""
    return bool(_saved)


def activate() -> None:
    """Make ``cuda`` the fake device in this process (idempotent). Refused where torch has a
    real CUDA device: the fake one would hide it."""
    with _lock:
        if _saved:
            return
        if torch.cuda.is_available():
            raise RuntimeError(
                f"{ENV}=1 on a machine with a CUDA device: unset it to run on the GPU"
            )
        for name in _FACTORIES:
            _patch(torch, name, _factory(getattr(torch, name)))
        for name in _NEW_METHODS:
            _patch(torch.Tensor, name, _new_method(getattr(torch.Tensor, name)))
        _patch(torch.Tensor, "to", to)
        _patch(torch.Tensor, "cuda", _cuda_method)
        _patch(torch.Tensor, "pin_memory", _pin_memory_method(torch.Tensor.pin_memory))
        _patch(torch, "Generator", Generator)
        for name, value in runtime.FUNCTIONS.items():
            _patch(torch.cuda, name, value)


def deactivate() -> None:
    """Undo ``activate()``; tensors already made keep reporting ``cuda``."""
    with _lock:
        while _saved:
            owner, name, original = _saved.pop()
            setattr(owner, name, original)


@contextlib.contextmanager
def activated() -> Iterator[None]:
    """The fake device for the duration of a ``with`` block (unless it was active before)."""
    was_active = is_active()
    activate()
    try:
        yield
    finally:
        if not was_active:
            deactivate()


def _patch(owner: object, name: str, value: object) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if is_cuda_device(kwargs.get("device")):
            return run_on(original, args, kwargs)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # no pinned-memory allocator without CUDA
        return original(*args, **kwargs)

    return factory


def _new_method(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, FakeCudaTensor) and is_cuda_device(kwargs.get("device")):
            return run_on(original, (self, *args), kwargs)
        return original(self, *args, **kwargs)

    return method


def _cuda_method(
    self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any
) -> torch.Tensor:
    return to(self, CUDA if device is None else device, non_blocking=non_blocking)


def _pin_memory_method(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(self, FakeCudaTensor):
            return original(self)  # raises, as pinning a CUDA tensor does
        return self.clone()  # a copy, not pinned: no pinned allocator without CUDA

    return pin_memory


class _GeneratorType(type(torch._C.Generator)):
    """Keeps ``isinstance(g, torch.Generator)`` true of every generator while it is patched."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, torch._C.Generator)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_GeneratorType):
    """``torch.Generator`` while the fake device is active: one made for ``cuda`` is a CPU
    generator that reports ``cuda``, so it draws what a CPU generator with its seed draws."""

    def __new__(cls, device: Any = "cpu") -> "Generator":
        is_cuda = is_cuda_device(device)
        generator = super().__new__(cls, "cpu" if is_cuda else device)
        generator._is_fake_cuda = is_cuda
        return generator

    @property
    def device(self) -> torch.device:
        return CUDA if self._is_fake_cuda else super().device
