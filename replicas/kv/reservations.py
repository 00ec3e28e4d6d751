"""Reservations: a waiting request's cached prefix, held until its admission and prefetched.

With ``ReservationPolicy.share`` > 0, a waiting request's cached prefix is held from the step
after its arrival until its admission, so running traffic cannot evict it, and its host-only
blocks are loaded into NPU blocks meanwhile (``prefetch`` loads)::

    reserve(request)      match; touch its NPU blocks; allocate + cache + plan a load for each
                          host-only one; all within share x the NPU blocks
    admission             match finds the reserved blocks on NPU and adopts them; the
                          reservation's references are then dropped (release)
    give way              before a running request is preempted, and before a waiting request
                          is refused its blocks, the newest reservation is dropped (newest first)

``prefetch=False`` (an ablation the simulator measures) holds only the prefix's leading
NPU-resident blocks and loads nothing.

A reservation never holds a block a running request needs: dropping every reservation restores
exactly the free blocks there would be without them.
"""

from dataclasses import dataclass
from typing import NamedTuple

from replicas.engine.request import Request
from replicas.kv.cache_type import CacheType
from replicas.kv.events import Tier, safe_prefix_length
from replicas.kv.hashing import BlockHash
from replicas.kv.journal import Journal
from replicas.kv.matching import PrefixMatcher
from replicas.kv.records import EMPTY_PART, CacheTypeMatch, PrefixMatch
from replicas.kv.type_manager import CacheTypeManager


class ReservationPolicy(NamedTuple):
    """How much of each cache type's NPU blocks waiting requests may hold (0: no
    reservations), and whether their host-only blocks are prefetched (False: hold the leading
    NPU-resident blocks only)."""

    share: float = 0.0
    prefetch: bool = True


NO_RESERVATIONS = ReservationPolicy()


@dataclass(slots=True)
class _Reservation:
    """A waiting request's hold on its cached prefix: one reference per NPU block."""

    blocks: dict[str, list[int]]  # cache type -> NPU blocks held, in prompt order
    prefetched: dict[str, list[int]]  # cache type -> those loaded from host for it
    prefetched_hashes: frozenset[BlockHash]  # primary cache type's loaded blocks


class Reservations:
    """The reservations of a manager's waiting requests, oldest first. Not thread-safe: the
    manager's engine loop calls it."""

    def __init__(
        self,
        managers: list[CacheTypeManager],
        matcher: PrefixMatcher,
        journal: Journal,
        policy: ReservationPolicy,
    ) -> None:
        """``managers``: one per cache type, the global-attention one first."""
        self.policy = policy
        self._managers = managers
        self._cache_types = [m.cache_type for m in managers]
        self._block_size = matcher.block_size
        self._matcher = matcher
        self._journal = journal
        self._held: dict[str, _Reservation] = {}  # oldest first

    @property
    def share(self) -> float:
        """The share of each cache type's NPU blocks waiting requests may hold (0: off)."""
        return self.policy.share

    def has(self, request_id: str) -> bool:
        return request_id in self._held

    def prefetched_hashes(self, request_id: str) -> frozenset[BlockHash]:
        """The primary cache type's blocks the request's reservation loaded from host."""
        reservation = self._held.get(request_id)
        return reservation.prefetched_hashes if reservation is not None else frozenset()

    def held_blocks(self, cache_type: str) -> list[list[int]]:
        """Every reservation's NPU blocks of one cache type (for integrity checks)."""
        return [r.blocks[cache_type] for r in self._held.values()]

    def reserve(self, request: Request) -> bool:
        """Hold a waiting request's cached prefix and prefetch its host-only blocks (mutates),
        within ``share`` of each cache type's NPU blocks; a prefix that does not fit is held as
        far as its halves do. False when nothing was reserved."""
        if not self.policy.share or request.request_id in self._held:
            return False
        if any(request.request_id in c.blocks for c in self._cache_types):
            raise ValueError(f"request {request.request_id} holds blocks: it is not waiting")
        match = self._matcher.match(request, None)
        length = self._reserved_length(request, match)
        if not length:
            return False
        if length != match.num_blocks:
            match = self._matcher.match(request, length)
        blocks: dict[str, list[int]] = {}
        prefetched: dict[str, list[int]] = {}
        for manager in self._managers:
            part = match.cache_types[manager.name]
            blocks[manager.name], prefetched[manager.name] = self._hold(manager, request, part)
        primary = self._cache_types[0]
        hashes = frozenset(primary.npu.blocks[b].block_hash for b in prefetched[primary.name])
        self._held[request.request_id] = _Reservation(blocks, prefetched, hashes)
        stats = self._journal.stats
        stats.reservations += 1
        stats.reserved_blocks += len(blocks[primary.name])
        stats.prefetched_blocks += len(prefetched[primary.name])
        return True

    @staticmethod
    def _hold(
        manager: CacheTypeManager, request: Request, part: CacheTypeMatch
    ) -> tuple[list[int], list[int]]:
        """Reference a cache type's matched NPU blocks and load its host-only ones into new
        NPU blocks; returns (every block held, those loaded)."""
        npu_ids, host_ids = part.block_ids(Tier.NPU), part.block_ids(Tier.HOST)
        manager.npu.touch([b for b in npu_ids if b is not None])
        held, loaded = [], []
        for offset, npu_id in enumerate(npu_ids):
            if npu_id is None:
                block_hash = request.block_hashes[part.first_block + offset]
                host_id = host_ids[offset]
                manager.cache_type.host.touch([host_id])  # locked until its load lands
                manager.count_host_hit(host_id)
                npu_id = manager.load(host_id, block_hash, prefetch=True)
                loaded.append(npu_id)
            held.append(npu_id)
        return held, loaded

    def _reserved_length(self, request: Request, match: PrefixMatch) -> int:
        """The blocks to reserve: ``match``'s, cut to its leading NPU-resident run without
        prefetch, then halved until they fit; the safe prefix of each length is computed from
        one lookup of every block, as ``match_prefix`` with that limit would find it."""
        table = _MatchTable(self._cache_types, request, match.num_blocks, self._block_size)
        length = match.num_blocks
        while not self.policy.prefetch and (run := table.npu_run(length)) < length:
            length = table.safe_length(run)
        while length and not self._fits(table, length):
            length = table.safe_length(length // 2)
        return length

    def _fits(self, table: "_MatchTable", length: int) -> bool:
        """Whether reserving ``length`` blocks keeps every cache type within its share of NPU
        blocks and leaves the free blocks its host-only blocks' loads need (no mutation)."""
        for cache_type in self._cache_types:
            npu = cache_type.npu
            npu_ids = table.npu_ids(cache_type, length)
            num_loads = sum(1 for b in npu_ids if b is None)
            num_revived = sum(1 for b in npu_ids if b is not None and not npu.blocks[b].ref_count)
            held = sum(len(r.blocks[cache_type.name]) for r in self._held.values())
            limit = int(self.policy.share * npu.num_blocks)
            if held + len(npu_ids) > limit or num_loads > npu.num_free - num_revived:
                return False
        return True

    def drop_newest(self, keep: str | None = None) -> str | None:
        """Give way: drop the newest reservation (not ``keep``'s); returns its request id, None
        if there is none."""
        for request_id in reversed(self._held):
            if request_id != keep:
                self._release(self._held.pop(request_id))
                self._journal.stats.reservations_dropped += 1
                return request_id
        return None

    def end(self, request_id: str, used: PrefixMatch | None = None) -> dict[str, set[int]]:
        """Drop a request's reservation, if it has one (admitted with ``used``, or freed);
        returns the NPU blocks it prefetched per cache type."""
        reservation = self._held.pop(request_id, None)
        if reservation is None:
            return {}
        self._release(reservation, used)
        return {name: set(ids) for name, ids in reservation.prefetched.items()}

    def _release(self, reservation: _Reservation, used: PrefixMatch | None = None) -> None:
        """Drop a reservation's references; count the prefetched blocks ``used`` adopted."""
        primary = self._cache_types[0].name
        stats = self._journal.stats
        if used is not None:
            adopted = set(used.cache_types.get(primary, EMPTY_PART).block_ids(Tier.NPU))
            stats.prefetched_blocks_used += sum(
                1 for b in reservation.prefetched[primary] if b in adopted
            )
        for cache_type in self._cache_types:
            cache_type.npu.free(list(reversed(reservation.blocks[cache_type.name])))
        stats.reserved_blocks -= len(reservation.blocks[primary])


class _MatchTable:
    """Every cache type's NPU lookups over a matched prefix, taken once, answering what
    ``match_prefix`` would find with a lower limit (no mutation happens in between)."""

    __slots__ = ("_block_size", "_cache_types", "_npu_ids", "_present")

    def __init__(
        self, cache_types: list[CacheType], request: Request, num_blocks: int, block_size: int
    ) -> None:
        hashes = request.block_hashes[:num_blocks]
        self._cache_types = cache_types
        self._block_size = block_size
        self._npu_ids = {c.name: [c.npu.lookup(h) for h in hashes] for c in cache_types}
        self._present = {c.name: [c.in_pools(h) for h in hashes] for c in cache_types[1:]}

    def safe_length(self, limit: int) -> int:
        """The safe prefix ``match_prefix(request, limit)`` finds (``limit`` at most the full
        match, whose primary blocks all exist)."""
        length = limit
        for cache_type in self._cache_types[1:]:
            present = self._present[cache_type.name][:length]
            window = cache_type.spec.sliding_window
            length = safe_prefix_length(present, length, self._block_size, window)
        return length

    def npu_ids(self, cache_type: CacheType, length: int) -> list[int | None]:
        """The cache type's NPU entries of a ``length``-block match (its window's, if sliding)."""
        first = cache_type.spec.window_start(length * self._block_size, self._block_size)
        return self._npu_ids[cache_type.name][first:length]

    def npu_run(self, length: int) -> int:
        """Leading blocks of a ``length``-block match before the first one some cache type
        holds on host only."""
        run = length
        for cache_type in self._cache_types:
            first = cache_type.spec.window_start(length * self._block_size, self._block_size)
            ids = self._npu_ids[cache_type.name][first:length]
            if None in ids:
                run = min(run, first + ids.index(None))
        return run
