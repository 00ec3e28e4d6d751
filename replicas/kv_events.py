"""Messages a replica publishes about its cache, for the router's virtual prefix index.

Together with ``replicas.hashing`` this is the whole contract between replicas and the router:
the router imports nothing else from ``replicas``. Every batch carries the replica's sequence
numbers, so a router that sees a gap knows its index missed events and asks for a snapshot.

``KVEventKind`` and ``Tier`` are string enums: each member equals (and serialises as) its plain
string value, so events, metric labels and JSON read the same as plain strings.
"""

from enum import StrEnum
from typing import NamedTuple

from replicas.hashing import BlockHash


class Tier(StrEnum):
    """A tier of KV blocks: NPU memory, or host memory behind it."""

    NPU = "npu"
    HOST = "host"


class KVEventKind(StrEnum):
    """What happened to a block hash in one tier."""

    STORED = "stored"  # the tier holds the hash from now on
    REMOVED = "removed"  # the tier no longer holds it


class KVEvent(NamedTuple):
    """A block hash entered (``stored``) or left (``removed``) one tier of one replica."""

    kind: KVEventKind
    tier: Tier
    block_hash: BlockHash


class KVEventBatch(NamedTuple):
    """Events ``first_seq .. first_seq + len(events) - 1`` of one replica, in order."""

    replica_index: int
    first_seq: int
    events: tuple[KVEvent, ...]

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.events)


class KVSnapshot(NamedTuple):
    """Every cached hash of one replica per tier, as of just before event ``next_seq``."""

    replica_index: int
    next_seq: int
    npu_hashes: tuple[BlockHash, ...]
    host_hashes: tuple[BlockHash, ...]
