"""A watchdog of the serving event loop: a loop that stops answering is a server that stalls.

Every request, stream and health check of the HTTP front runs on one event loop; a call that
blocks it (a lock held by another thread, a synchronous call into Ray, a slow regex) stalls
them all while the process sits idle. A daemon thread asks the loop for a heartbeat every
``interval_s``::

    heartbeat answered                  -> the loop is live; a stall that was logged ends, and
                                           its length is logged
    no answer for ``stall_s``           -> logged once per stall, with the stack of every thread
                                           (the loop's own stack names the blocking call)

``/health`` reports the stalls seen (count, longest, the one in progress) so a stall that ended
is still visible to whoever looks.
"""

import asyncio
import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoopHealth:
    stalls: int  # stalls of at least ``stall_s`` seen since start
    longest_stall_s: float
    blocked_s: float  # how long the loop has not answered now (0 while it answers)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "stalls": self.stalls,
            "longest_stall_s": round(self.longest_stall_s, 3),
            "blocked_s": round(self.blocked_s, 3),
        }


class LoopWatchdog:
    def __init__(self, stall_s: float = 2.0, interval_s: float | None = None) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be positive, got {stall_s}")
        self.stall_s = stall_s
        self.interval_s = interval_s if interval_s is not None else min(0.5, stall_s / 4)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._last_beat = time.monotonic()
        self._stalls = 0
        self._longest = 0.0
        self._in_stall = False  # the current stall was logged

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch ``loop`` (the running serving loop) from a daemon thread."""
        self._loop = loop
        self._last_beat = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch, name="strata-loop-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def health(self) -> LoopHealth:
        with self._lock:
            blocked = time.monotonic() - self._last_beat
            return LoopHealth(
                self._stalls,
                max(self._longest, blocked if self._in_stall else 0.0),
                blocked if blocked >= self.stall_s else 0.0,
            )

    def _beat(self) -> None:
        """Runs on the loop: it answered."""
        now = time.monotonic()
        with self._lock:
            blocked = now - self._last_beat
            self._last_beat = now
            ended = self._in_stall
            self._in_stall = False
            if ended:
                self._longest = max(self._longest, blocked)
        if ended:
            logger.warning("the serving event loop answered again after %.1f s", blocked)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            loop = self._loop
            if loop is None or loop.is_closed():
                return
            try:
                loop.call_soon_threadsafe(self._beat)
            except RuntimeError:  # the loop closed between the check and the call
                return
            with self._lock:
                blocked = time.monotonic() - self._last_beat
                fresh = blocked >= self.stall_s and not self._in_stall
                if fresh:
                    self._in_stall = True
                    self._stalls += 1
            if fresh:
                logger.error(
                    "the serving event loop has not answered for %.1f s; every thread's "
                    "stack follows\n%s",
                    blocked,
                    thread_stacks(),
                )


def thread_stacks() -> str:
    """The stack of every thread of this process, named, innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    return "\n".join(parts)
