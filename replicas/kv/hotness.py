"""How hot each cached block is: its recent prefix hits, decayed exponentially.

A block's *hit weight* is the number of new requests that matched it, each counted with a weight
that halves every ``HIT_HALF_LIFE_S`` seconds since the hit::

    weight(now) = sum over hits of 0.5 ** ((now - hit time) / HIT_HALF_LIFE_S)

One entry per block hash holds ``(weight at last update, time of last update)``; a hit decays
the entry to now and adds 1 (one dict update per matched block on the admission path). The map
is bounded: at most ``capacity`` hashes (the NPU and host blocks of the cache), the least
recently hit dropped first, so a block held but not hit for long reads weight 0.

Scaling reads the weights: the router's victim choice (``hot_blocks``), the order in which a
draining replica writes its blocks to the node's disk tier, and the weight each disk record
keeps (``replicas.kv.disk``) so that a replica starting on that node loads the hottest first.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterable

from replicas.kv.hashing import BlockHash

HIT_HALF_LIFE_S = 120.0
"""Seconds after which a hit counts half. Shared by every replica of a node, since disk records
written by one are ranked by another."""


def decayed(weight: float, age_s: float) -> float:
    """``weight`` recorded ``age_s`` seconds ago, as of now."""
    return weight * 0.5 ** (max(age_s, 0.0) / HIT_HALF_LIFE_S)


class HitWeights:
    """Decayed hit counts per block hash, bounded to ``capacity`` hashes. Not thread-safe: the
    engine loop updates and reads it."""

    __slots__ = ("_capacity", "_clock", "_entries")

    def __init__(self, capacity: int, clock: Callable[[], float]) -> None:
        self._capacity = max(1, capacity)
        self._clock = clock
        self._entries: OrderedDict[BlockHash, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def hit(self, block_hashes: Iterable[BlockHash]) -> None:
        """Count one hit on each block (mutates)."""
        now = self._clock()
        entries = self._entries
        for block_hash in block_hashes:
            entry = entries.pop(block_hash, None)
            weight = 1.0 if entry is None else decayed(entry[0], now - entry[1]) + 1.0
            entries[block_hash] = (weight, now)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def weight(self, block_hash: BlockHash) -> float:
        """The block's hit weight now (0.0 when it has no recent hit)."""
        entry = self._entries.get(block_hash)
        return 0.0 if entry is None else decayed(entry[0], self._clock() - entry[1])

    def weights(self, block_hashes: Iterable[BlockHash]) -> dict[BlockHash, float]:
        """Each block's hit weight now, one clock reading for all."""
        now = self._clock()
        entries = self._entries
        result = {}
        for block_hash in block_hashes:
            entry = entries.get(block_hash)
            result[block_hash] = 0.0 if entry is None else decayed(entry[0], now - entry[1])
        return result
