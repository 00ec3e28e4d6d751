"""Host memory for the host KV tier: checked, allocated and faulted in at start-up.

A gather from never-written memory pays a page fault per page and runs several times slower
than from resident memory (benchmarks/README.md, ``transfer``), so every page of a host pool is
written once here, before any transfer. A pool that cannot fit fails now, with a clear error,
rather than later under load.
"""

import logging
import math
import os

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


def check_host_capacity(num_bytes: int, what: str = "host KV tier") -> None:
    """Fail if ``num_bytes`` cannot fit in available memory; warn about hugepages on Linux."""
    info = read_meminfo()
    available = info.get("MemAvailable")
    if available is not None and num_bytes > available:
        raise MemoryError(
            f"the {what} needs {num_bytes / 2**30:.2f} GiB of host memory but only "
            f"{available / 2**30:.2f} GiB is available; lower "
            "--experimental-kv-offload-host-memory-gb (or the ratio)"
        )
    page = info.get("Hugepagesize")
    if page and os.name == "posix":
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
