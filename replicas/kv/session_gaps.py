"""How long an interactive session's blocks stay protected from batch traffic, learned from the
gaps between its own turns.

A session is the requests sharing a ``prompt_cache_key`` (``CacheHints.key``). Each new request
of a session records the gap since the session's previous one; once a session has shown
``MIN_GAPS`` gaps, its blocks are protected for ``GAP_FACTOR`` x the longest of its last
``NUM_GAPS`` gaps, within [``MIN_LIFETIME_S``, ``MAX_LIFETIME_S``]: long enough for its next turn
to come, with room for a slower one, and no longer. Requests of a session within
``SAME_TURN_S`` of its last turn belong to that turn (a request's ``n`` sequences, parallel
tool calls). A request without a key, or of a session with too short a history, gets the
configured lifetime (``PrefixCacheConfig.interactive_lifetime_s``). At most ``MAX_SESSIONS``
sessions are remembered, the least recently seen forgotten first.

The same learned lifetime bounds how long a session's prompt-cache retention lasts
(``learned_s``, ``replicas.cache_hints.CacheHints.bounded``): a session that asks to keep its
prefix for longer than its own turns have needed keeps it just long enough for its next turn.
"""

import time
from collections import OrderedDict, deque
from collections.abc import Callable

NUM_GAPS = 8
MIN_GAPS = 2
GAP_FACTOR = 1.5
MIN_LIFETIME_S = 30.0
MAX_LIFETIME_S = 3600.0
MAX_SESSIONS = 4096
SAME_TURN_S = 1.0


class SessionGaps:
    """Each session's recent gaps between turns, and the lifetime they call for."""

    def __init__(
        self,
        default_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self.default_s = default_s
        self._clock = clock
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[float, deque[float]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def turn(self, key: str | None) -> float:
        """Record a request of session ``key`` now; the lifetime its blocks are protected for."""
        if key is None:
            return self.default_s
        now = self._clock()
        last, gaps = self._sessions.pop(key, (None, deque(maxlen=NUM_GAPS)))
        if last is not None and now - last < SAME_TURN_S:
            now = last  # the same turn
        elif last is not None:
            gaps.append(now - last)
        self._sessions[key] = (now, gaps)
        if len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        return self.lifetime_s(gaps)

    def learned_s(self, key: str | None) -> float | None:
        """The lifetime session ``key``'s own gaps call for (as ``turn`` returns it), or None
        while it has none: no key, a session forgotten or with fewer than ``MIN_GAPS`` gaps."""
        _, gaps = self._sessions.get(key, (None, ())) if key is not None else (None, ())
        return self.lifetime_s(gaps) if len(gaps) >= MIN_GAPS else None

    def lifetime_s(self, gaps: "deque[float] | list[float] | tuple[float, ...]") -> float:
        if len(gaps) < MIN_GAPS:
            return self.default_s
        return min(MAX_LIFETIME_S, max(MIN_LIFETIME_S, GAP_FACTOR * max(gaps)))
