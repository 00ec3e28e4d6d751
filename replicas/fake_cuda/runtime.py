"""The ``torch.cuda`` calls of the fake device: one device, ``cuda:0``, whose memory is the host's.

Work runs on the CPU when it is issued, so streams and events are already complete whenever
asked: every wait is met, every query is true, and an event's time is when it was recorded.
CUDA graphs are refused: code that captures them checks ``replicas.fake_cuda.is_active()``.
"""

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from replicas.fake_cuda.tensor import CUDA, is_cuda_device

DEVICE_NAME = "Strata fake CUDA (CPU)"


class Stream:
    """A stream of the fake device (``torch.cuda.Stream``)."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        is_cuda_device(CUDA if device is None else device)
        self.device = CUDA
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, stream: "Stream") -> None:
        _check_stream(stream)

    def wait_event(self, event: "Event") -> None:
        _check_event(event)

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> "Stream":
        self._context = stream(self)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)


class Event:
    """An event of the fake device (``torch.cuda.Event``)."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self._recorded_s: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        if stream is not None:
            _check_stream(stream)
        self._recorded_s = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        if stream is not None:
            _check_stream(stream)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds from this event's record to ``end_event``'s."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_s is None or end_event._recorded_s is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_s - self._recorded_s) * 1e3


def _check_stream(value: object) -> None:
    if not isinstance(value, Stream):
        raise TypeError(f"expected a torch.cuda.Stream of the fake device, got {value!r}")


def _check_event(value: object) -> None:
    if not isinstance(value, Event):
        raise TypeError(f"expected a torch.cuda.Event of the fake device, got {value!r}")


_DEFAULT_STREAM = Stream()
_current = threading.local()


def current_stream(device: Any = None) -> Stream:
    is_cuda_device(CUDA if device is None else device)
    return getattr(_current, "stream", _DEFAULT_STREAM)


def default_stream(device: Any = None) -> Stream:
    is_cuda_device(CUDA if device is None else device)
    return _DEFAULT_STREAM


def set_stream(value: Stream) -> None:
    _check_stream(value)
    _current.stream = value


@contextlib.contextmanager
def stream(value: Stream | None) -> Iterator[None]:
    """``torch.cuda.stream``: ``value`` is the current stream inside (``None`` changes nothing)."""
    if value is None:
        yield
        return
    previous = current_stream()
    set_stream(value)
    try:
        yield
    finally:
        set_stream(previous)


@dataclass(frozen=True, slots=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports of the fake device."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: bool = True


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes: the host's available and physical memory (the fake device's
    tensors live there)."""
    is_cuda_device(CUDA if device is None else device)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return _available_bytes(total), total


def _available_bytes(total: int) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(total, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def get_device_properties(device: Any = None) -> DeviceProperties:
    is_cuda_device(CUDA if device is None else device)
    return DeviceProperties(DEVICE_NAME, 8, 0, mem_get_info()[1], os.cpu_count() or 1)


def get_device_name(device: Any = None) -> str:
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    properties = get_device_properties(device)
    return properties.major, properties.minor


def set_device(device: Any) -> None:
    is_cuda_device(device)


def synchronize(device: Any = None) -> None:
    is_cuda_device(CUDA if device is None else device)


def manual_seed(seed: int) -> None:
    """The fake device draws from the CPU's default generator, so this seeds that one
    (``torch.manual_seed`` calls this too)."""
    torch.default_generator.manual_seed(seed)


def refuse_graphs(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "CUDA graphs cannot be captured on STRATA_FAKE_CUDA's fake device: check "
        "replicas.fake_cuda.is_active() before capturing"
    )


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


FUNCTIONS: dict[str, Any] = {
    "is_available": lambda: True,
    "is_initialized": lambda: True,
    "_lazy_init": _none,
    "device_count": lambda: 1,
    "current_device": _zero,
    "set_device": set_device,
    "synchronize": synchronize,
    "Stream": Stream,
    "Event": Event,
    "current_stream": current_stream,
    "default_stream": default_stream,
    "set_stream": set_stream,
    "stream": stream,
    "mem_get_info": mem_get_info,
    "get_device_properties": get_device_properties,
    "get_device_name": get_device_name,
    "get_device_capability": get_device_capability,
    "is_bf16_supported": lambda *args, **kwargs: True,
    "empty_cache": _none,
    "memory_allocated": _zero,
    "max_memory_allocated": _zero,
    "memory_reserved": _zero,
    "reset_peak_memory_stats": _none,
    "manual_seed": manual_seed,
    "manual_seed_all": manual_seed,
    "is_current_stream_capturing": lambda: False,
    "CUDAGraph": refuse_graphs,
    "graph": refuse_graphs,
    "make_graphed_callables": refuse_graphs,
}
"""Attributes of ``torch.cuda`` replaced while the fake device is active."""
