"""The router's virtual prefix index: which replica holds which block, in which tier.

Fed only by the replicas' KV events and snapshots (``replicas.kv.events``); it never sees a
replica's blocks, only their hashes. Because block hashes chain (``replicas.kv.hashing``), a
prompt's cached prefix on a replica is the leading run of its block hashes that the replica holds.
"""

import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from itertools import repeat, takewhile
from typing import NamedTuple

from replicas.kv.events import (
    FULL,
    KVEventBatch,
    KVEventKind,
    KVSnapshot,
    Tier,
    backing_tiers,
    per_tier,
    tier_count,
    tiers,
)
from replicas.kv.hashing import BlockHash

_LANE_BITS = 8
"""Replicas per lane: ``match`` scans one byte per block and lane with C-level bytes methods."""
_BIT_TABLES = tuple(bytes((x >> bit) & 1 for x in range(256)) for bit in range(_LANE_BITS))
"""``_BIT_TABLES[b]`` translates a lane byte to 1 if bit b is set, else 0."""


class IndexMatch(NamedTuple):
    """The cached prefix of one prompt on one replica, in blocks per tier: a per-tier tuple
    (``replicas.kv.events.tiers()`` order, one entry per tier).

    A block held in both NPU and host counts as NPU (it is reusable without a reload). Blocks
    of the backing tiers (``router.backing_index``) continue the prefix after the NPU/host run.
    A match built before a tier was registered is shorter: its missing entries count 0.
    """

    num_blocks_by_tier: tuple[int, ...]

    @classmethod
    def of(cls, num_blocks: Mapping[Tier, int]) -> "IndexMatch":
        """The match of ``num_blocks`` per tier (0 for the tiers it lacks)."""
        return cls(per_tier(num_blocks))

    @property
    def num_blocks(self) -> int:
        return sum(self.num_blocks_by_tier)

    def num_blocks_in(self, tier: Tier) -> int:
        return tier_count(self.num_blocks_by_tier, tier)

    def with_blocks(self, num_blocks: Mapping[Tier, int]) -> "IndexMatch":
        """This match with ``num_blocks[tier]`` in each tier of ``num_blocks`` instead."""
        order = tiers()
        num_blocks_by_tier = list(self.num_blocks_by_tier)
        num_blocks_by_tier += [0] * (len(order) - len(num_blocks_by_tier))
        for tier, count in num_blocks.items():
            num_blocks_by_tier[order.index(tier)] = count
        return IndexMatch(tuple(num_blocks_by_tier))


@cache
def _empty(num_tiers: int) -> tuple[IndexMatch, tuple[int, ...]]:
    """With ``num_tiers`` tiers registered: no match, and a ``PrefixIndex`` match's entries for
    the tiers after NPU and host, which it does not hold."""
    past_host = (0,) * (num_tiers - 2)
    return IndexMatch((0, 0, *past_host)), past_host


class PrefixIndex:
    """Per block hash, the replicas holding it on NPU and on host, for all replicas at once.

    One dict maps each hash to one packed int (no per-entry object), in three fields of
    ``W = 8 * ceil(num_replicas / 8)`` bits, bit r of each field standing for replica r::

        holders[block_hash] = any | host_only << W | host << 2W
        any       = held in some tier (npu | host)     } what match reads, one byte per
        host_only = held on host but not on NPU         } lane of 8 replicas
        host      = held on host (with any and host_only, recovers npu = any & ~host_only)

    Invariants (``check_integrity``): no entry is 0 (a hash no replica holds is deleted); every
    entry is the encoding of its own (npu, host) masks; ``num_npu_blocks(r)`` and
    ``num_host_blocks(r)`` count the entries with replica r in that tier. Events are idempotent
    per (replica, tier): storing a held block or removing an absent one changes nothing. Not
    thread-safe; the owner (``Router``) serialises calls.
    """

    def __init__(self, num_replicas: int, cache_type: str = FULL) -> None:
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        self.num_replicas = num_replicas
        self.cache_type = cache_type  # events and snapshot hashes of other cache types: ignored
        self._num_lanes = -(-num_replicas // _LANE_BITS)
        self._field_bits = _LANE_BITS * self._num_lanes
        self._field_mask = (1 << self._field_bits) - 1
        self._holders: dict[BlockHash, int] = {}
        self._num_npu = [0] * num_replicas
        self._num_host = [0] * num_replicas
        self._all_of_tables: dict[int, bytes] = {}

    def __len__(self) -> int:
        """Number of distinct block hashes held by at least one replica."""
        return len(self._holders)

    def num_npu_blocks(self, replica: int) -> int:
        return self._num_npu[replica]

    def num_host_blocks(self, replica: int) -> int:
        return self._num_host[replica]

    def apply(self, batch: KVEventBatch) -> None:
        """Apply every event of ``batch`` in order (mutates). Sequence numbers are the caller's
        business; raises ValueError on an unknown event kind or tier."""
        replica = batch.replica_index
        self._check_replica(replica)
        bit = 1 << replica
        holders, width, field = self._holders, self._field_bits, self._field_mask
        npu_tier, host_tier = Tier.NPU, Tier.HOST  # locals: enum attributes are slow to read
        backing = frozenset(backing_tiers())  # router.backing_index follows these
        stored, removed = KVEventKind.STORED, KVEventKind.REMOVED
        cache_type = self.cache_type
        for kind, tier, block_hash, event_cache_type in batch.events:
            if event_cache_type != cache_type or tier in backing:
                continue
            entry = holders.get(block_hash, 0)
            npu, host = entry & ~(entry >> width) & field, entry >> (2 * width)  # _decode inline
            if tier == npu_tier:
                held, counts = npu, self._num_npu
            elif tier == host_tier:
                held, counts = host, self._num_host
            else:
                raise ValueError(f"unknown KV event tier {tier!r}")
            if kind == stored:
                if held & bit:
                    continue
                counts[replica] += 1
            elif kind == removed:
                if not held & bit:
                    continue
                counts[replica] -= 1
            else:
                raise ValueError(f"unknown KV event kind {kind!r}")
            if tier == npu_tier:
                npu ^= bit
            else:
                host ^= bit
            if npu | host:  # _store inline: this loop runs for every block a replica caches
                holders[block_hash] = (npu | host) | (host & ~npu) << width | host << (2 * width)
            else:
                del holders[block_hash]

    def load_snapshot(self, snapshot: KVSnapshot) -> None:
        """Replace everything known of the snapshot's replica by its content (mutates)."""
        replica = snapshot.replica_index
        self.clear_replica(replica)
        bit = 1 << replica
        npu_hashes = snapshot.hashes(Tier.NPU, self.cache_type)
        host_hashes = snapshot.hashes(Tier.HOST, self.cache_type)
        for block_hash in npu_hashes:
            npu, host = self._decode(self._holders.get(block_hash, 0))
            if not npu & bit:
                self._store(block_hash, npu | bit, host)
                self._num_npu[replica] += 1
        for block_hash in host_hashes:
            npu, host = self._decode(self._holders.get(block_hash, 0))
            if not host & bit:
                self._store(block_hash, npu, host | bit)
                self._num_host[replica] += 1

    def add_replica(self) -> int:
        """Grow the index by one replica holding nothing; its index (mutates). Past a lane of
        8 replicas every entry is re-encoded at the wider field width: one pass, as rare as a
        resize."""
        masks = None
        if self.num_replicas % _LANE_BITS == 0:
            masks = {h: self._decode(entry) for h, entry in self._holders.items()}
        replica = self.num_replicas
        self.num_replicas += 1
        self._num_npu.append(0)
        self._num_host.append(0)
        if masks is not None:
            self._num_lanes = -(-self.num_replicas // _LANE_BITS)
            self._field_bits = _LANE_BITS * self._num_lanes
            self._field_mask = (1 << self._field_bits) - 1
            self._holders = {h: self._encode(npu, host) for h, (npu, host) in masks.items()}
        return replica

    def clear_replica(self, replica: int) -> None:
        """Forget every block of ``replica`` (mutates). One pass over the whole index, so meant
        for rare events (death, resync); free when the replica holds nothing."""
        self._check_replica(replica)
        if not self._num_npu[replica] and not self._num_host[replica]:
            return
        bit = 1 << replica
        for block_hash in [h for h, entry in self._holders.items() if entry & bit]:
            npu, host = self._decode(self._holders[block_hash])
            self._store(block_hash, npu & ~bit, host & ~bit)
        self._num_npu[replica] = 0
        self._num_host[replica] = 0

    def match(self, block_hashes: Sequence[BlockHash], replicas: Iterable[int]) -> list[IndexMatch]:
        """Cached prefix of a prompt on each replica (read-only).

        Returns one ``IndexMatch`` per replica index (``num_replicas`` of them); replicas not in
        ``replicas`` get no match (0 blocks). A replica's match is the longest leading run of
        ``block_hashes`` it holds in any tier, counted per tier.

        One pass of dict look-ups stops at the first hash no replica holds; the entries are then
        laid out as bytes, one per block and lane of 8 replicas, and each lane narrows its set of
        replicas still matching with ``bytes.translate`` + ``find`` (at most 9 C-level scans per
        lane), so no Python code runs per block.
        """
        candidates = 0
        for replica in replicas:
            self._check_replica(replica)
            candidates |= 1 << replica
        entries = list(takewhile(bool, map(self._holders.get, block_hashes, repeat(0))))
        raw, stride = self._entry_bytes(entries)
        num_lanes = self._num_lanes
        no_match, past_host = _empty(len(Tier))
        matches = [no_match] * self.num_replicas
        for lane in range(num_lanes):
            still = (candidates >> (lane * _LANE_BITS)) & 0xFF
            if not still:
                continue
            any_bytes = raw[lane::stride]
            host_only_bytes = raw[num_lanes + lane :: stride]
            pos = 0
            while still:
                # Every replica in `still` holds blocks [0, pos); find the first block one lacks.
                pos = any_bytes.translate(self._all_of_table(still)).find(0, pos)
                if pos < 0:
                    pos = len(entries)
                held = any_bytes[pos] if pos < len(entries) else 0
                if pos:  # replicas dropping out at block 0 keep no match
                    for bit in _bits(still & ~held):
                        num_host = host_only_bytes[:pos].translate(_BIT_TABLES[bit]).count(1)
                        num_blocks = (pos - num_host, num_host, *past_host)
                        matches[lane * _LANE_BITS + bit] = IndexMatch(num_blocks)
                still &= held
        return matches

    def holds(self, block_hashes: Sequence[BlockHash], replica: int) -> list[bool]:
        """Whether ``replica`` holds each of ``block_hashes`` in some tier (read-only)."""
        bit = 1 << replica
        get = self._holders.get
        return [bool(get(h, 0) & bit) for h in block_hashes]

    def count_tiers(self, block_hashes: Sequence[BlockHash], replica: int) -> IndexMatch:
        """``block_hashes``, all held by ``replica``, counted per tier (read-only)."""
        bit = 1 << replica << self._field_bits
        get = self._holders.get
        num_host = sum(1 for h in block_hashes if get(h, 0) & bit)
        return IndexMatch((len(block_hashes) - num_host, num_host, *_empty(len(Tier))[1]))

    def check_integrity(self) -> None:
        """Raise AssertionError unless every entry is well formed and the counts agree."""
        n = self.num_replicas
        num_npu = [0] * n
        num_host = [0] * n
        for block_hash, entry in self._holders.items():
            npu, host = self._decode(entry)
            assert npu | host, f"index entry {block_hash.hex()} held by no replica"
            assert entry == self._encode(npu, host), f"malformed entry {block_hash.hex()}"
            assert (npu | host) >> n == 0, f"index entry {block_hash.hex()} has stray bits"
            for replica in range(n):
                num_npu[replica] += (npu >> replica) & 1
                num_host[replica] += (host >> replica) & 1
        assert num_npu == self._num_npu, f"NPU counts {self._num_npu} != entries {num_npu}"
        assert num_host == self._num_host, f"host counts {self._num_host} != entries {num_host}"

    def _encode(self, npu: int, host: int) -> int:
        width = self._field_bits
        return (npu | host) | (host & ~npu) << width | host << (2 * width)

    def _decode(self, entry: int) -> tuple[int, int]:
        """``(npu_mask, host_mask)`` of an entry (0 decodes to ``(0, 0)``)."""
        width, field = self._field_bits, self._field_mask
        return entry & ~(entry >> width) & field, entry >> (2 * width)

    def _store(self, block_hash: BlockHash, npu: int, host: int) -> None:
        if npu | host:
            self._holders[block_hash] = self._encode(npu, host)
        else:
            self._holders.pop(block_hash, None)

    def _entry_bytes(self, entries: list[int]) -> tuple[bytes, int]:
        """The entries as little-endian fixed-width records: ``(bytes, record size)``."""
        num_bytes = 3 * self._num_lanes
        typecode = "I" if num_bytes <= 4 else "Q" if num_bytes <= 8 else ""
        if typecode and array(typecode).itemsize >= num_bytes:
            packed = array(typecode, entries)
            if sys.byteorder == "big":  # pragma: no cover - every supported platform is little
                packed.byteswap()
            return packed.tobytes(), packed.itemsize
        return b"".join(map(int.to_bytes, entries, repeat(num_bytes), repeat("little"))), num_bytes

    def _all_of_table(self, lane_mask: int) -> bytes:
        """Translation of a lane byte to 1 if it holds every replica of ``lane_mask``, else 0."""
        table = self._all_of_tables.get(lane_mask)
        if table is None:
            table = bytes(int(x & lane_mask == lane_mask) for x in range(256))
            self._all_of_tables[lane_mask] = table
        return table

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica index {replica} out of range 0..{self.num_replicas - 1}")


def _bits(mask: int) -> Iterable[int]:
    """Indices of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
