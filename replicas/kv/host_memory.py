"""Host memory for the host KV tier: checked, allocated and faulted in at start-up.

A gather from never-written memory pays a page fault per page and runs several times slower
than from resident memory (benchmarks/README.md, ``transfer``), so every page of a host pool is
written once here, before any transfer. A pool that cannot fit fails now, with a clear error,
rather than later under load.

On CUDA the host pools are one ``HostSlab``: a mapping of exactly their size, pinned with
``cudaHostRegister`` (torch's pinned allocator would round each pool up to a power of two). On
CPU each pool is an ordinary tensor (``allocate_host_tensor``).
"""

import logging
import math
import mmap
import os
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


def read_meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty off Linux)."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if not parts:
                    continue
                value = int(parts[0])
                info[key] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    except OSError:
        return {}
    return info


def check_host_capacity(
    num_bytes: int, what: str = "host KV tier", *, hugepages: bool = True
) -> None:
    """Fail if ``num_bytes`` cannot fit in available memory; warn about hugepages on Linux
    (unless ``hugepages`` is False: warned already). On CUDA ``num_bytes`` is the pinned
    slab's exact size (``slab_bytes``)."""
    info = read_meminfo()
    available = info.get("MemAvailable")
    if available is not None and num_bytes > available:
        raise MemoryError(
            f"the {what} needs {num_bytes / 2**30:.2f} GiB of host memory but only "
            f"{available / 2**30:.2f} GiB is available; lower "
            "--experimental-kv-offload-host-memory-gb (or the ratio)"
        )
    page = info.get("Hugepagesize")
    if hugepages and page and os.name == "posix":
        needed = math.ceil(num_bytes / page)
        free = info.get("HugePages_Free", 0)
        if needed > free:
            logger.warning(
                "the %s (%.2f GiB) would need %d free hugepages of %d KiB to be backed by them; "
                "%d are free, so it uses regular pages",
                what,
                num_bytes / 2**30,
                needed,
                page // 1024,
                free,
            )


def allocate_host_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A zero-filled host tensor with every page resident (pinned when ``pin``)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    check_host_capacity(num_bytes)
    try:
        tensor = torch.empty(shape, dtype=dtype, pin_memory=pin)
    except RuntimeError as error:
        raise MemoryError(
            f"could not allocate {num_bytes / 2**30:.2f} GiB of "
            f"{'pinned ' if pin else ''}host memory for the host KV tier: {error}"
        ) from error
    tensor.fill_(0)  # fault every page in now, not during the first transfer
    return tensor


HUGEPAGE_BYTES = 2 << 20
"""A transparent hugepage (x86-64, most arm64 kernels): what ``hugepage_zeros`` aligns to."""


def hugepage_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in an anonymous mapping of its own, aligned to ``HUGEPAGE_BYTES``,
    with transparent hugepages advised (``MADV_HUGEPAGE``) before its pages are faulted in.

    For a CPU KV cache: attention reads each head's keys and values a block at a time, a few
    KiB here and there across the whole cache, so with 4 KiB pages nearly every block read
    starts on a page whose translation is not cached (``benchmarks/README.md``, "KV cache on
    hugepages"). A tensor under one hugepage, or where the platform has no ``madvise``, is an
    ordinary ``torch.zeros``; the kernel may still back the mapping with small pages (THP off,
    or no free hugepage), which changes nothing but speed."""
    num_bytes = _nbytes(shape, dtype)
    if num_bytes < HUGEPAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    mapped = _mmap(num_bytes + HUGEPAGE_BYTES, 0)
    if mapped is None:
        return torch.zeros(shape, dtype=dtype)
    mapped.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping while it lives
    start = -whole.data_ptr() % HUGEPAGE_BYTES
    tensor = whole[start : start + num_bytes].view(dtype).view(shape)
    tensor.fill_(0)  # fault every page in now, as hugepages where the kernel grants them
    return tensor


MAP_HUGETLB = 0x40000
"""Linux's ``mmap`` flag for reserved hugepages (Python's ``mmap`` module does not name it)."""

SLAB_ALIGN_BYTES = 4096
"""Where each pool starts inside a slab: a page boundary, whatever its dtype."""


def slab_bytes(pool_bytes: list[int], page_bytes: int = SLAB_ALIGN_BYTES) -> int:
    """Bytes of one slab holding ``pool_bytes`` back to back, each pool starting on a
    ``SLAB_ALIGN_BYTES`` boundary, the whole rounded up to ``page_bytes``: what is mapped and
    pinned, and what the capacity check counts."""
    offset = 0
    for num_bytes in pool_bytes:
        offset = _round_up(offset, SLAB_ALIGN_BYTES) + num_bytes
    return _round_up(offset, page_bytes)


def host_tier_bytes(pool_bytes: list[int], *, pinned: bool) -> int:
    """Host memory the host pools take: one pinned slab (``slab_bytes``) on CUDA, the pools'
    own bytes on CPU."""
    return slab_bytes(pool_bytes) if pinned else sum(pool_bytes)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class HostRegistrar(Protocol):
    """Page-locks memory Strata allocated itself (``cudaHostRegister``), so the device copies
    to and from it directly."""

    def register(self, address: int, num_bytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class HostSlab:
    """One anonymous mapping of exactly the host pools' bytes (page-rounded), pinned by
    ``registrar``, with one tensor view per pool.

    torch's pinned allocator rounds each allocation up to a power of two (a 40 GiB pool pins
    64 GiB); a mapping of our own pins what the pools need. Reserved hugepages back it when
    enough are free (``MAP_HUGETLB``, faulted in by ``MAP_POPULATE``), else regular pages with
    transparent hugepages advised, then written once. Either way every page is resident before
    the first transfer.
    """

    def __init__(
        self,
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
        registrar: HostRegistrar,
        what: str = "host KV tier",
    ) -> None:
        sizes = {name: _nbytes(shape, dtype) for name, (shape, dtype) in shapes.items()}
        self._map, self.nbytes, self.on_hugepages = _map_slab(list(sizes.values()), what)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        if not self.on_hugepages:
            self._bytes.fill_(0)  # fault every page in now (as huge ones where THP allows)
        self.address = self._bytes.data_ptr()
        self._registrar: HostRegistrar | None = registrar
        registrar.register(self.address, self.nbytes)
        self.tensors: dict[str, torch.Tensor] = {}
        offset = 0
        for name, (shape, dtype) in shapes.items():
            offset = _round_up(offset, SLAB_ALIGN_BYTES)
            view = self._bytes[offset : offset + sizes[name]].view(dtype).view(shape)
            self.tensors[name] = view
            offset += sizes[name]
        logger.info(
            "%s: one pinned slab of %d bytes (%.2f GiB, %s pages) for %s",
            what,
            self.nbytes,
            self.nbytes / 2**30,
            "huge" if self.on_hugepages else "regular",
            ", ".join(f"{name}: {num} bytes" for name, num in sizes.items()),
        )

    def release(self) -> None:
        """Unpin the slab (every copy into or out of it must have landed); idempotent."""
        if self._registrar is not None:
            self._registrar.unregister(self.address)
            self._registrar = None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _map_slab(pool_bytes: list[int], what: str) -> "tuple[mmap.mmap, int, bool]":
    """The slab's mapping, its size and whether reserved hugepages back it: hugepages when
    enough are free and the kernel grants them, else regular pages (transparent hugepages
    advised) after the capacity check."""
    info = read_meminfo()
    huge = info.get("Hugepagesize", 0)
    if huge and slab_bytes(pool_bytes, huge) <= huge * info.get("HugePages_Free", 0):
        num_bytes = slab_bytes(pool_bytes, huge)  # the free hugepages hold it
        mapped = _mmap(num_bytes, MAP_HUGETLB | getattr(mmap, "MAP_POPULATE", 0))
        if mapped is not None:
            return mapped, num_bytes, True
    num_bytes = slab_bytes(pool_bytes)
    check_host_capacity(num_bytes, what, hugepages=False)  # the engine warned already
    mapped = _mmap(num_bytes, 0)
    if mapped is None:
        raise MemoryError(
            f"could not map {num_bytes / 2**30:.2f} GiB of host memory for the {what}"
        )
    if hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_HUGEPAGE)
    return mapped, num_bytes, False


def _mmap(num_bytes: int, extra_flags: int) -> "mmap.mmap | None":
    """An anonymous private mapping; None when the kernel refuses ``extra_flags``."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | extra_flags
    try:
        return mmap.mmap(-1, num_bytes, flags=flags)
    except OSError:
        return None
