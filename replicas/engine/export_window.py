"""Reading a replica's cached blocks while its engine computes a step, for a peer pulling them
(``replicas.kv.tiers.peer``), instead of waiting for the step to end.

While the engine thread runs a step's forward pass, nothing changes which block holds which
hash: the scheduler, the cache manager and the step's update run before and after it, and a
cached (hashed) block is never written; on the CPU the step's copies between tiers ran before
the forward, at once (a device with copies in flight on side streams does not read here). So
another thread may read the NPU and host blocks of any hash while the forward runs, and the
engine thread waits for it, if it has not finished, before it updates anything::

    engine thread    schedule, copies | forward ............ | update
    export thread                     |   read blocks (held)  |   <- waits for the read
                                       window open

``ExportWindow`` is that window; ``export_in_step`` tries it for a while before the caller
waits for the step to end as before. The copies are made without torch's thread pool (one
plain memcpy each), so that a read beside a forward never starts a second OpenMP team.
"""

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")

WINDOW_POLL_S = 0.002
"""How often a read that found the window shut looks again while the engine steps."""
WINDOW_TRIES = 250
"""How many looks before the read waits for the step to end instead (about half a second of
the engine between forward passes)."""


class ExportWindow:
    """Open while the engine thread runs a forward pass; a read run in it holds it shut."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Open the window for the forward pass run in the block; on leaving, wait for a read
        in progress."""
        with self._lock:
            self._open = True
        try:
            yield
        finally:
            with self._lock:
                self._open = False

    def run_if_open(self, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """``(True, fn())`` if the window is open (the forward waits for ``fn`` to end before
        the step goes on), else ``(False, None)`` at once."""
        with self._lock:
            if not self._open:
                return False, None
            return True, fn()


def copy_block(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a contiguous CPU block, made by one memcpy outside torch's thread pool."""
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    return torch.from_numpy(np.array(raw, copy=True)).view(tensor.dtype).view(tensor.shape)


async def export_in_step(
    is_stepping: Callable[[], bool],
    window: ExportWindow,
    read: Callable[[], T],
    executor: Executor,
) -> tuple[bool, T | None]:
    """Run ``read`` on ``executor`` in the window of a forward pass: ``(True, its result)``, or
    ``(False, None)`` when the engine stopped stepping or no window opened within
    ``WINDOW_TRIES`` looks (the caller then reads between steps)."""
    loop = asyncio.get_running_loop()
    for _ in range(WINDOW_TRIES):
        if not is_stepping():
            return False, None
        done, result = await loop.run_in_executor(executor, window.run_if_open, read)
        if done:
            return True, result
        await asyncio.sleep(WINDOW_POLL_S)
    return False, None
