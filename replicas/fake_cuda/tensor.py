"""Tensors made for ``cuda`` on a machine without one: CPU tensors that say they are on ``cuda:0``.

A ``FakeCudaTensor`` is a CPU tensor (its values are real, computed by the CPU kernels) whose
``device`` reads ``cuda:0``, so every ``x.device.type == "cuda"`` / ``x.is_cuda`` branch takes its
CUDA side. Every torch call that involves one passes through ``__torch_function__``, which checks
the devices of its tensors as a GPU would before running it on the CPU:

- a call mixing ``cuda`` and ``cpu`` tensors raises the ``RuntimeError`` real CUDA raises
  ("Expected all tensors to be on the same device ..."), except where CUDA accepts the mix:
  0-dim CPU tensors (scalars), CPU index tensors of an indexing (``x[i]``, ``x[i] = v``,
  ``index_put_``), and copies (``copy_``, ``to``, ``cpu``, ``x[a:b] = v``);
- a generator must be on the device of the tensors it draws for;
- a CUDA tensor turned into a NumPy array, or pinned, raises as on CUDA.

Outputs are tagged ``cuda`` when the call ran on the device (a ``cuda`` input or
``device="cuda"``); ``cpu()`` and ``to("cpu")`` return plain CPU copies.

The checks see what Python sees: a mix that only C++ code inside one call makes (a composite
op building a CPU tensor internally) is not seen, and a 0-dim CPU tensor is accepted by every
op, where CUDA accepts it only in elementwise ones; a ``cuda`` generator given to a call on CPU
tensors alone is not seen either (no fake tensor takes part in the call).
"""

from collections.abc import Callable, Iterator
from typing import Any

import torch

CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_INDEXING = ("__getitem__", "__setitem__", "index_put_", "index_put", "_index_put_impl_")


def _disabled() -> torch._C.DisableTorchFunctionSubclass:
    return torch._C.DisableTorchFunctionSubclass()


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports ``cuda:0`` and checks the devices of every call it is in."""

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(_name(func))
        if handler is not None:
            return handler(func, args, kwargs)
        check_devices(func, args, kwargs)
        if kwargs.get("device") is not None:
            return run_on(func, args, kwargs)
        with _disabled():
            out = func(*args, **kwargs)
        return tag(out)


def device_of(x: torch.Tensor) -> torch.device:
    """The device ``x`` reports (``cuda:0`` for a fake CUDA tensor)."""
    return CUDA if isinstance(x, FakeCudaTensor) else x.device


def tag(out: Any) -> Any:
    """``out`` with every tensor in it tagged ``cuda`` (the same storage, no copy)."""
    if isinstance(out, torch.Tensor):
        return out if isinstance(out, FakeCudaTensor) else out.as_subclass(FakeCudaTensor)
    if isinstance(out, (tuple, list)):
        return type(out)(tag(x) for x in out)
    return out


def plain(x: torch.Tensor) -> torch.Tensor:
    """The CPU tensor under ``x`` (the same storage), as a plain tensor."""
    with _disabled():
        return x.as_subclass(torch.Tensor) if isinstance(x, FakeCudaTensor) else x


def is_cuda_device(device: Any) -> bool:
    """Whether ``device`` (a string, ``torch.device`` or an index) names a CUDA device; a CUDA
    device other than ``cuda:0`` raises, as a missing device does on a real machine."""
    if device is None:
        return False
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if device.index not in (None, 0):
        raise RuntimeError(
            f"CUDA error: invalid device ordinal ({device}): STRATA_FAKE_CUDA models one "
            "device, cuda:0"
        )
    return True


def run_on(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` whose ``device=`` keyword names where its output goes."""
    on_cuda = is_cuda_device(kwargs["device"])
    kwargs = {**kwargs, "device": _CPU}
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False  # no pinned-memory allocator without CUDA
    check_generator(kwargs.get("generator"), CUDA if on_cuda else _CPU)
    with _disabled():
        out = func(*args, **kwargs)
    return tag(out) if on_cuda else out


def check_devices(func: Callable, args: tuple, kwargs: dict) -> None:
    """Raise where a GPU would: ``cuda`` tensors mixed with CPU tensors other than scalars."""
    cuda = cpu = None
    for t in _tensors(args, kwargs):
        if isinstance(t, FakeCudaTensor):
            cuda = t
        elif t.dim() or t.device.type != "cpu":
            cpu = t
    if cuda is not None and cpu is not None:
        raise RuntimeError(_mismatch(_name(func), cpu.device))
    generator = kwargs.get("generator")  # keyword-only in every torch call that draws
    if generator is not None:
        on_cuda = cuda is not None or _device_kwarg_is_cuda(kwargs)
        check_generator(generator, CUDA if on_cuda else _CPU)


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    if generator is None:
        return
    where = generator.device
    if where.type != device.type:
        raise RuntimeError(
            f"Expected a '{device.type}' device type for generator but found '{where.type}'"
        )


def _device_kwarg_is_cuda(kwargs: dict) -> bool:
    return is_cuda_device(kwargs.get("device"))


def _mismatch(name: str, other: torch.device) -> str:
    return (
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"cuda:0 and {other}! (in {name}, STRATA_FAKE_CUDA)"
    )


def _name(func: Callable) -> str:
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a property of Tensor: name it by its descriptor
        return f"{getattr(func.__self__, '__name__', '')}.__get__"
    return name or str(func)


def _tensors(args: tuple, kwargs: dict | None = None) -> Iterator[torch.Tensor]:
    """The tensors among ``args`` and ``kwargs``' values, and in the lists and tuples there."""
    for values in (args, kwargs.values() if kwargs else ()):
        for x in values:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (tuple, list)):
                yield from _tensors(x)


# ---- calls that move data or read the device: each handled by itself --------------------------


def _run(func: Callable, args: tuple, kwargs: dict) -> Any:
    with _disabled():
        return func(*args, **kwargs)


def _copy(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``dst.copy_(src)`` copies across devices; it returns ``dst`` as it is."""
    _run(func, args, kwargs)
    return args[0]


def _cpu(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    self = args[0]
    if not isinstance(self, FakeCudaTensor):
        return _run(func, args, kwargs)
    with _disabled():
        return plain(self).clone()  # a copy, as from device memory


def _cuda(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    is_cuda_device(device if device is not None else CUDA)
    self = args[0]
    if isinstance(self, FakeCudaTensor):
        return self
    with _disabled():
        return tag(self.clone())


def _numpy(func: Callable, args: tuple, kwargs: dict) -> Any:
    raise TypeError(
        "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
        "tensor to host memory first."
    )


def _pin_memory(func: Callable, args: tuple, kwargs: dict) -> Any:
    if isinstance(args[0], FakeCudaTensor):
        raise RuntimeError("cannot pin 'torch.cuda.Tensor' only dense CPU tensors can be pinned")
    with _disabled():
        return args[0].clone()  # a copy, not pinned: no pinned allocator without CUDA


def _indexing(func: Callable, args: tuple, kwargs: dict) -> Any:
    """CUDA indexing takes CPU index tensors; an indexed CPU tensor takes no CUDA index, and an
    advanced assignment needs its values on the indexed tensor's device."""
    name = _name(func)
    self, index = args[0], args[1] if len(args) > 1 else kwargs.get("indices")
    on = device_of(self)
    indices = list(_tensors((index,)))
    if on.type == "cpu" and any(isinstance(i, FakeCudaTensor) for i in indices):
        raise RuntimeError(
            "indices should be either on cpu or on the same device as the indexed tensor (cpu)"
        )
    values = args[2] if len(args) > 2 else kwargs.get("values")
    is_advanced = bool(indices) or _has_sequence(index) or name != "__setitem__"
    if isinstance(values, torch.Tensor) and is_advanced and values.dim():
        if device_of(values) != on:
            raise RuntimeError(_mismatch(name, _CPU))
    out = _run(func, args, kwargs)
    if name == "__setitem__":
        return out
    if name in ("index_put_", "_index_put_impl_"):
        return self
    return tag(out) if on.type == "cuda" else out


def _has_sequence(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in items)


def _shallow_copy_type(func: Callable, args: tuple, kwargs: dict) -> bool:
    """A fake CUDA tensor never replaces a CPU one's data in place (``param.data = x``), so
    ``nn.Module.to`` makes new parameters of it, as it does for a real device change."""
    if isinstance(args[0], FakeCudaTensor) != isinstance(args[1], FakeCudaTensor):
        return False
    return _run(func, args, kwargs)


def _repr(func: Callable, args: tuple, kwargs: dict) -> str:
    text = repr(plain(args[0]))
    return f"{text[:-1]}, device='cuda:0')" if text.endswith(")") else text


def _constant(value: Any) -> Callable[..., Any]:
    return lambda func, args, kwargs: value


def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.to`` on the fake device: moves between ``cpu`` and ``cuda`` by copying."""
    original = _ORIGINAL_TO
    copy = kwargs.pop("copy", False)
    if args and isinstance(args[0], torch.Tensor):
        other, rest = args[0], args[1:]
        device, dtype = device_of(other), other.dtype
        non_blocking = rest[0] if rest else kwargs.get("non_blocking", False)
        memory_format = kwargs.get("memory_format", torch.preserve_format)
    else:
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    source = device_of(self)
    target = source if device is None else (CUDA if is_cuda_device(device) else device)
    if target.type == source.type == "cpu":
        return original(self, *args, copy=copy, **kwargs)
    moved = target.type != source.type
    with _disabled():
        out = original(
            plain(self),
            device=_CPU if target.type == "cuda" else target,
            dtype=dtype,
            non_blocking=non_blocking,
            copy=copy or moved,
            memory_format=memory_format or torch.preserve_format,
        )
    if target.type != "cuda":
        return out
    if not moved and out.data_ptr() == self.data_ptr() and out.dtype == self.dtype:
        return self  # already there: ``to`` returns its own tensor
    return tag(out)


def _to(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    return to(*args, **kwargs)


_ORIGINAL_TO = torch.Tensor.to
_HANDLERS: dict[str, Callable[[Callable, tuple, dict], Any]] = {
    "device.__get__": _constant(CUDA),
    "is_cuda.__get__": _constant(True),
    "is_cpu.__get__": _constant(False),
    "get_device": _constant(0),
    "is_pinned": _constant(False),
    "record_stream": _constant(None),
    "copy_": _copy,
    "cpu": _cpu,
    "cuda": _cuda,
    "to": _to,
    "numpy": _numpy,
    "__array__": _numpy,
    "pin_memory": _pin_memory,
    "__repr__": _repr,
    "_has_compatible_shallow_copy_type": _shallow_copy_type,
    **dict.fromkeys(_INDEXING, _indexing),
}
