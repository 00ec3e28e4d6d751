"""Messages a replica publishes about its cache, for the router's virtual prefix index.

Together with ``replicas.kv.hashing`` and ``replicas.step_costs`` this is the whole contract
between replicas and the router: the router imports nothing else from ``replicas``. Every batch
carries the replica's sequence numbers, so a router that sees a gap knows its index missed events
and asks for a snapshot.

``KVEventKind`` and ``Tier`` are string enums: each member equals (and serialises as) its plain
string value, so events, metric labels and JSON read the same as plain strings.
"""

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple

from replicas.kv.hashing import BlockHash


class Tier(StrEnum):
    """A tier of KV blocks: NPU memory, host memory behind it, or local disk behind that (shared
    by the replicas of one node: a router credits a disk block to each of them)."""

    NPU = "npu"
    HOST = "host"
    DISK = "disk"


TIERS: tuple[Tier, ...] = tuple(Tier)
"""Every tier, nearest first: the order of a per-tier tuple, whose entry i counts ``TIERS[i]``.
Records that count per tier (a router's match, a request's cached tokens) carry such a tuple, so
a new tier adds an entry, not a field."""
_TIER_INDEX = {tier: i for i, tier in enumerate(TIERS)}


def per_tier(counts: Mapping[Tier, int]) -> tuple[int, ...]:
    """``counts`` as a per-tier tuple: one entry per tier of ``TIERS``, 0 where ``counts`` has
    none."""
    return tuple(counts.get(tier, 0) for tier in TIERS)


def tier_count(counts: Sequence[int], tier: Tier) -> int:
    """The entry of the per-tier tuple ``counts`` for ``tier`` (0 past its end)."""
    i = _TIER_INDEX[tier]
    return counts[i] if i < len(counts) else 0


class KVEventKind(StrEnum):
    """What happened to a block hash in one tier."""

    STORED = "stored"  # the tier holds the hash from now on
    REMOVED = "removed"  # the tier no longer holds it


FULL = "full"
SLIDING = "sliding"
"""Cache types: global attention's KV (every model) and sliding-window attention's (hybrid)."""


def window_start(num_tokens: int, block_size: int, sliding_window: int | None) -> int:
    """First block a token at position ``num_tokens`` still attends to (0 for global)."""
    if sliding_window is None:
        return 0
    return max(0, num_tokens - sliding_window + 1) // block_size


def safe_prefix_length(
    present: Sequence[bool], limit: int, block_size: int, sliding_window: int | None
) -> int:
    """Longest ``L <= limit`` whose window (blocks ``window_start(L * block_size)`` to
    ``L - 1``) is all ``present`` (``present[i]``: block i is cached in some tier). A replica's
    prefix match and the router's score of a hybrid model's prompt both apply this rule."""
    last_missing = -1
    best = 0
    for length in range(limit + 1):
        first = window_start(length * block_size, block_size, sliding_window)
        if last_missing < first:
            best = length
        if length < limit and not present[length]:
            last_missing = length
    return best


class KVEvent(NamedTuple):
    """A block hash entered (``stored``) or left (``removed``) one tier of one cache type of one
    replica. A hybrid model's replica publishes its ``sliding`` blocks too, so a router can
    credit a prefix only as far as its sliding window is cached (the safe prefix)."""

    kind: KVEventKind
    tier: Tier
    block_hash: BlockHash
    cache_type: str = FULL


class KVEventBatch(NamedTuple):
    """Events ``first_seq .. first_seq + len(events) - 1`` of one replica, in order."""

    replica_index: int
    first_seq: int
    events: tuple[KVEvent, ...]

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.events)


class KVSnapshot(NamedTuple):
    """Every cached hash of one replica, per cache type and tier, as of just before event
    ``next_seq``: ``block_hashes[cache_type][tier]`` (a hybrid model's ``sliding`` cache type beside
    the global ``full`` one; a tier the replica lacks is absent)."""

    replica_index: int
    next_seq: int
    block_hashes: Mapping[str, Mapping[Tier, tuple[BlockHash, ...]]]

    def hashes(self, tier: Tier, cache_type: str = FULL) -> tuple[BlockHash, ...]:
        """The hashes one tier of one cache type holds (none for a tier it lacks)."""
        return self.block_hashes.get(cache_type, {}).get(Tier(tier), ())
