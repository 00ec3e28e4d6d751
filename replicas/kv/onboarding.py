"""The backing tiers' reads: onboarding waiting requests' blocks from disk (and any tier behind
host) into host blocks.

(What goes from host to a backing tier is each cache type's own rule:
``replicas.kv.backing_writes``.) A prefix match never waits on a backing tier: ``onboard``
looks past a waiting request's NPU/host match, and when backing tiers hold the next blocks and
``reload_pays`` says loading them beats computing them again, it plans their reads (each from
the nearest tier holding it) into locked host blocks and the request waits (the scheduler
admits others meanwhile)::

    onboard(request)      backing-only blocks after the match -> host blocks, reads planned
    complete_loads        a landed read caches its host block (a failed one: a miss, forgotten)
    admission             the match finds the blocks on host and loads them to NPU as usual

A read that has not landed ``max(ONBOARD_TIMEOUT_MIN_S, ONBOARD_TIMEOUT_FACTOR x its predicted
time)`` after it was planned, on the manager's clock, is given up on: its request is admitted
with what landed, and the host block stays locked until the read ends.
"""

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from replicas.engine.request import Request
from replicas.kv.cache_type import CacheType
from replicas.kv.events import Tier, safe_prefix_length
from replicas.kv.hashing import BlockHash
from replicas.kv.journal import Journal
from replicas.kv.matching import PrefixMatcher
from replicas.kv.records import BackingCopy
from replicas.kv.type_manager import CacheTypeManager

ONBOARD_TIMEOUT_MIN_S = 2.0
ONBOARD_TIMEOUT_FACTOR = 8.0
"""A waiting request stops waiting for its reads after ``max(ONBOARD_TIMEOUT_MIN_S,
ONBOARD_TIMEOUT_FACTOR x their predicted time)``."""


class ReloadCosts(NamedTuple):
    """The cost rule's inputs, seconds per block (``recompute_s`` 0 until measured, when the rule
    reads every backing prefix); ``read_s``: per backing tier; ``read_fixed_s``: per backing
    tier whose reads also cost something per call, whatever their size (the peer tier's)."""

    recompute_s: float
    host_load_s: float
    read_s: dict[str, float]
    read_fixed_s: Mapping[str, float] = MappingProxyType({})

    @property
    def disk_read_s(self) -> float:
        """Deprecated: ``read_s["disk"]``."""
        warnings.warn(
            "ReloadCosts.disk_read_s is deprecated; read ReloadCosts.read_s['disk']",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.read_s.get("disk", 0.0)


def read_seconds_fixed(store: object) -> float:
    """What one read of a backing store costs whatever its size: the peer tier's round trip
    (``read_seconds_fixed``), 0 for a store without one."""
    fixed = getattr(store, "read_seconds_fixed", None)
    return float(fixed()) if fixed is not None else 0.0


def reload_pays(num_blocks: int, read_s: float, recompute_s: float, host_load_s: float) -> bool:
    """The cost rule: whether loading ``num_blocks`` matched blocks, after reads into host
    that take ``read_s`` seconds in all, takes less time than computing them again (seconds
    per block for ``recompute_s`` and ``host_load_s``)."""
    return read_s + num_blocks * host_load_s < num_blocks * recompute_s


@dataclass(slots=True)
class _Onboarding:
    """A waiting request's reads: what it waits for and the host blocks it holds."""

    waiting: set[tuple[str, BlockHash]]  # (cache type, hash) not landed yet
    held: dict[tuple[str, int], str]  # (cache type, host block) referenced for it -> tier
    deadline: float


_DECIDED = _Onboarding(set(), {}, 0.0)
"""A request decided once not to wait (later steps skip the lookups); never mutated."""


class Onboarding:
    """The backing tiers' reads for a manager's cache types (inert without one). Not
    thread-safe: the manager's engine loop calls it."""

    def __init__(
        self,
        managers: list[CacheTypeManager],
        matcher: PrefixMatcher,
        journal: Journal,
        clock: Callable[[], float],
    ) -> None:
        """``managers``: one per cache type, the global-attention one first."""
        self._managers = managers
        self._cache_types = [m.cache_type for m in managers]
        self._by_name = {c.name: c for c in self._cache_types}
        self._block_size = matcher.block_size
        self._matcher = matcher
        self._journal = journal
        self._clock = clock
        self._onboarding: dict[str, _Onboarding] = {}
        self._inflight: dict[tuple[str, BlockHash], tuple[int, set[str]]] = {}  # -> host, waiters
        self._tiers: dict[str, frozenset[str]] = {}  # request -> the tiers it reads from
        self._recompute_s: float | None = None  # measured seconds per block (set_costs)
        self._host_load_s = 0.0

    @property
    def is_on(self) -> bool:
        return bool(self._cache_types[0].backing)

    @property
    def num_onboarding(self) -> int:
        """Waiting requests whose reads have not all landed."""
        return sum(1 for o in self._onboarding.values() if o.waiting)

    # ---- onboarding ----------------------------------------------------------------------------
    def onboard(self, request: Request, max_blocks: int | None = None) -> bool:
        """Whether a waiting request must wait for reads (mutates): reads are planned the first
        time backing tiers hold blocks past its match and ``reload_pays``; True until they
        land or time out."""
        if not self.is_on or not self._matcher.enabled:
            return False
        onboarding = self._onboarding.get(request.request_id)
        if onboarding is not None:
            if not onboarding.waiting:
                return False
            if self._clock() > onboarding.deadline:
                for tier in set(onboarding.held.values()):
                    self._journal.stats.tier(tier).load_timeouts += 1
                onboarding.waiting.clear()
                return False
            return True
        if request.num_cached_tokens is not None:  # resumed after preemption: not new traffic
            return False
        match = self._matcher.match(request, max_blocks)
        plan = self._extension(request, match.num_blocks, max_blocks)
        if plan is None:  # decided once per request: later steps skip the lookups
            self._onboarding[request.request_id] = _DECIDED
            return False
        length, reads = plan
        for cache_type in self._cache_types:  # host blocks to read into: asked again later
            new = [
                h for h, _ in reads[cache_type.name] if (cache_type.name, h) not in self._inflight
            ]
            if len(new) > cache_type.host.num_free:
                return False
        primary = self._cache_types[0]
        read_s = sum(
            primary.store_of(t).read_seconds_per_block() for r in reads.values() for _, t in r
        )
        used = {t for r in reads.values() for _, t in r}
        read_s += sum(read_seconds_fixed(primary.store_of(t)) for t in used)
        if self._recompute_s is not None and not reload_pays(
            length - match.num_blocks, read_s, self._recompute_s, self._host_load_s
        ):
            for tier in used:
                self._journal.stats.tier(tier).recomputes += 1
            self._onboarding[request.request_id] = _DECIDED
            return False
        for tier in used:
            self._journal.stats.tier(tier).reloads += 1
        timeout = max(ONBOARD_TIMEOUT_MIN_S, ONBOARD_TIMEOUT_FACTOR * read_s)
        self._plan_reads(request.request_id, reads, self._clock() + timeout)
        return True

    def _plan_reads(
        self, request_id: str, reads: dict[str, list[tuple[BlockHash, str]]], deadline: float
    ) -> None:
        """Read each block into a locked host block (one read per block, shared by every
        request waiting for it)."""
        waiting: set[tuple[str, BlockHash]] = set()
        held: dict[tuple[str, int], str] = {}
        for manager in self._managers:
            cache_type = manager.cache_type
            for block_hash, tier in reads[cache_type.name]:
                key = (cache_type.name, block_hash)
                inflight = self._inflight.get(key)
                if inflight is None:
                    host_id = manager.allocate_host()
                    cache_type.host.touch([host_id])  # the read's reference and the waiter's
                    inflight = self._inflight[key] = (host_id, set())
                    copy = BackingCopy(host_id, block_hash, cache_type.name, tier=tier)
                    self._journal.plan.backing_loads.append(copy)
                else:
                    cache_type.host.touch([inflight[0]])  # the waiter's reference
                inflight[1].add(request_id)
                waiting.add(key)
                held[(cache_type.name, inflight[0])] = tier
        self._onboarding[request_id] = _Onboarding(waiting, held, deadline)

    def read_for_warm_start(
        self, manager: CacheTypeManager, tier: str, block_hash: BlockHash
    ) -> None:
        """Plan a read of a block of backing tier ``tier`` into a new host block for no
        request (a replica filling its host tier: a new one before it serves, a survivor taking
        a leaving replica's blocks); it lands as any read does (``complete_loads``: cached and
        announced). Call only while the host tier has a free block; without an empty one, the
        least recently used cached block is evicted."""
        cache_type = manager.cache_type
        key = (cache_type.name, block_hash)
        if key in self._inflight or cache_type.in_pools(block_hash):
            return
        host_id = manager.allocate_host()  # the read's reference
        self._inflight[key] = (host_id, set())
        copy = BackingCopy(host_id, block_hash, cache_type.name, tier=tier)
        self._journal.plan.backing_loads.append(copy)

    def _extension(
        self, request: Request, num_matched: int, max_blocks: int | None
    ) -> tuple[int, dict[str, list[tuple[BlockHash, str]]]] | None:
        """The longest safe prefix with backing blocks counted, and per cache type the blocks
        of it that only backing tiers hold, each with the nearest tier holding it; None when
        they add nothing (no mutation)."""
        limit = (request.num_tokens - 1) // self._block_size
        limit = limit if max_blocks is None else min(limit, max_blocks)
        hashes = request.block_hashes[:limit]
        primary = self._cache_types[0]
        length = num_matched
        while length < len(hashes) and primary.anywhere(hashes[length]):
            length += 1
        for cache_type in self._cache_types[1:]:
            present = [cache_type.anywhere(h) for h in hashes[:length]]
            length = safe_prefix_length(
                present, length, self._block_size, cache_type.spec.sliding_window
            )
        if length <= num_matched:
            return None
        reads = {}
        for cache_type in self._cache_types:
            first = cache_type.spec.window_start(length * self._block_size, self._block_size)
            reads[cache_type.name] = [
                (h, _nearest(cache_type, h))
                for h in hashes[first:length]
                if not cache_type.in_pools(h)
            ]
        return length, reads

    def complete_loads(self, results: list[tuple[BackingCopy, bool]]) -> None:
        """Record reads that ended: a valid block is cached in its host block; a miss frees
        the host block and its tier forgets the block."""
        stats = self._journal.stats
        for copy, ok in results:
            cache_type = self._by_name[copy.cache_type]
            key = (copy.cache_type, copy.block_hash)
            host_id, waiters = self._inflight.pop(key)
            host = cache_type.host
            if ok and host.cache(host_id, copy.block_hash):
                stats.tier(copy.tier).blocks_loaded += 1
                self._journal.stored(cache_type.name, Tier.HOST, copy.block_hash)
            elif not ok:
                stats.tier(copy.tier).load_failures += 1
                cache_type.store_of(copy.tier).discard(copy.block_hash)
            for request_id in waiters:
                onboarding = self._onboarding.get(request_id)
                if onboarding is not None:
                    onboarding.waiting.discard(key)
            host.free([host_id])  # the read's own reference; waiters hold theirs

    def end(self, request_id: str) -> dict[tuple[str, int], str]:
        """Stop onboarding a request (admitted or freed): release its host blocks; returns the
        (cache type, host block) pairs it held for its reads, with the tier each came from."""
        onboarding = self._onboarding.pop(request_id, None)
        if onboarding is None:
            return {}
        for name, host_id in onboarding.held:
            self._by_name[name].host.free([host_id])
        for key in onboarding.waiting:
            inflight = self._inflight.get(key)
            if inflight is not None:
                inflight[1].discard(request_id)
        return onboarding.held

    # ---- the cost rule -------------------------------------------------------------------------
    def reload_costs(self) -> ReloadCosts | None:
        """What ``reload_pays`` weighs now (None without a backing tier)."""
        primary = self._cache_types[0]
        if not primary.backing:
            return None
        read_s = {b.tier: b.store.read_seconds_per_block() for b in primary.backing}
        fixed = {b.tier: read_seconds_fixed(b.store) for b in primary.backing}
        fixed = {tier: seconds for tier, seconds in fixed.items() if seconds}
        return ReloadCosts(self._recompute_s or 0.0, self._host_load_s, read_s, fixed)

    def set_costs(self, recompute_s: float, host_load_s: float) -> None:
        """Measured seconds per block to recompute and to load from host."""
        self._recompute_s = recompute_s
        self._host_load_s = host_load_s


def _nearest(cache_type: "CacheType", block_hash: BlockHash) -> str:
    """The nearest backing tier of ``cache_type`` that holds the block."""
    return next(b.tier for b in cache_type.backing if b.holds(block_hash))
