"""A clairvoyant host retention policy: a bound for the adaptive one, not a policy to run.

``retention="clairvoyant"`` stores a block leaving the NPU tier (with no host copy) exactly when
the trace requests it again within ``window_s`` seconds of the eviction: it reads the future,
which no replica can. As under the adaptive policy every store is decided at eviction (none at
the promotion threshold), and a disk tier's stores are decided as the adaptive policy decides
them; the host tier's LRU eviction and every other rule stay as in the real manager, so a run
shows how many hits a store decision could buy at most with a given number of stores, and so
whether a shortfall of the adaptive policy lies in its prediction of reuse or elsewhere. The
miss-ratio curve's shadows follow the bound too (``ShadowKey(f, "clairvoyant")``).
"""

import bisect
from collections.abc import Callable, Iterable

from replicas.kv.hashing import BlockHash
from replicas.kv.retention import AdaptivePolicy, PolicyContext, PolicyFactory

CLAIRVOYANT = "clairvoyant"

Arrivals = dict[BlockHash, list[float]]
"""Block hash -> the sorted arrival times of the requests whose prompts hold it."""


def arrivals_by_block(requests: Iterable[tuple[float, list[BlockHash]]]) -> Arrivals:
    """The ``Arrivals`` of ``(arrival time, prompt block hashes)`` pairs."""
    arrivals: Arrivals = {}
    for arrival_s, hashes in requests:
        for block_hash in hashes:
            arrivals.setdefault(block_hash, []).append(arrival_s)
    for times in arrivals.values():
        times.sort()
    return arrivals


class ClairvoyantPolicy(AdaptivePolicy):
    """The adaptive policy with its store decision at NPU eviction read from the trace's
    future."""

    curve_name = CLAIRVOYANT

    def __init__(
        self,
        context: PolicyContext,
        arrivals: Arrivals,
        clock: Callable[[], float],
        window_s: float,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"the clairvoyant window must be positive, got {window_s}")
        super().__init__(context)
        self._arrivals = arrivals
        self._clock = clock
        self.window_s = window_s

    def should_store(self, block_hash: BlockHash, num_hits: int, host_full: bool) -> bool:
        times = self._arrivals.get(block_hash)
        if not times:
            return False  # decoded tokens, or a prompt block no request holds
        now = self._clock()
        later = bisect.bisect_right(times, now)
        return later < len(times) and times[later] - now <= self.window_s


def clairvoyant(arrivals: Arrivals, clock: Callable[[], float], window_s: float) -> PolicyFactory:
    """A factory the manager takes as its ``retention``: a bound per cache type."""
    if window_s <= 0:
        raise ValueError(f"the clairvoyant window must be positive, got {window_s}")
    return lambda context: ClairvoyantPolicy(context, arrivals, clock, window_s)
