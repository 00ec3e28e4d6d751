"""Which KV blocks each request uses, per cache type, across the NPU tier and the host tier.

The manager decides; it holds no tensors. Each engine step it hands a ``TransferPlan`` (host
blocks to load into NPU blocks, NPU blocks to store into host blocks) to the transfer component,
which moves the bytes. The simulator drives this very class with no tensors at all.

Cache types: a dense model has one, ``full``; a hybrid model adds ``sliding`` for its
sliding-window layers. Each cache type has its own NPU and host pools and hash maps over the same
block hashes. Residency is derived from those maps, never kept in parallel flags::

    NPU only       h in the NPU map, not the host map    reusable now; lost on NPU eviction
    host only      h in the host map, not the NPU map    reload into a new NPU block first
    NPU and host   h in both maps                        reusable now; survives NPU eviction

Safe prefix (hybrid): ``L`` leading blocks are reusable only if global KV exists (either tier)
for all ``L`` and sliding KV exists (either tier) for the window ending at the match point::

    block:      0   1   2   3   4   5   6   7 | 8 ...      (L = 8, window spans blocks 6..7)
    full:       *   *   *   *   *   *   *   * |
    sliding:    -   -   -   -   -   -   *   * |            ("-" need not exist)

Sliding blocks that leave a running request's window are released at once (they stay cached).

Host retention policies (DESIGN section 4), per cache type:
  * write-through promotion: a *hit* is a new request matching an NPU-resident block (the write
    that created the block is not one). When a block's hits reach ``write_through_threshold``
    and it has no host copy, it is stored to host. Threshold 0 stores every block when it is
    first written; ``None`` disables promotion.
  * write-back: when allocation evicts an NPU-only cached block, it is stored to host first.
  * adaptive (``retention="adaptive"``): every store made at NPU eviction: a block that reached
    the promotion threshold is stored then (not when it reached it), any other when the reuse
    observed after eviction pays for it at the measured costs (``replicas.kv.retention``).
Every cache type with a host tier also keeps ghost records and shadow host tiers
(``RetentionTracker``): ghost hits and the miss-ratio curve, whatever the policy.

Reservations (``reservation_share`` > 0): a waiting request's cached prefix is held from the
step after its arrival until its admission, so running traffic cannot evict it, and its host-only
blocks are loaded into NPU blocks meanwhile (``prefetch`` loads, which a GPU overlaps with
compute)::

    reserve(request)      match; touch its NPU blocks; allocate + cache + plan a load for each
                          host-only one; all within reservation_share x the NPU blocks
    admission             match finds the reserved blocks on NPU and adopts them; the
                          reservation's references are then dropped (record_admission)
    give way              before a running request is preempted, and before a waiting request
                          is refused its blocks, the newest reservation is dropped (newest first)

``reservation_prefetch=False`` (an ablation the simulator measures) holds only the prefix's
leading NPU-resident blocks and loads nothing.

A reservation never holds a block a running request needs: dropping every reservation restores
exactly the free blocks there would be without them.

Disk tier (``disk`` stores per cache type, behind the host tier; ``replicas.kv.disk``): blocks
leave host for disk by the rules that move them from NPU to host (a host block whose hits reach
``write_through_threshold`` is stored, every host block at threshold 0; with write-back, a
host-only block that host eviction takes is stored first). A prefix match never waits on disk:
``onboard`` looks past a waiting request's NPU/host match, and when the disk holds the next
blocks and ``reload_pays`` says loading them beats computing them again, it plans their reads
into locked host blocks and the request waits (the scheduler admits others meanwhile)::

    onboard(request)      disk-only blocks after the match -> host blocks, locked, reads planned
    complete_disk_loads   a landed read caches its host block (a failed one: a miss, forgotten)
    admission             the match finds the blocks on host and loads them to NPU as usual

A read that has not landed ``onboard_timeout`` after it was planned is given up on: its request
is admitted with what landed, and the host block stays locked until the read ends.

Ordering: the transfer component runs a plan's stores before its loads and both before the
next forward pass, so a store reads an evicted block before new KV overwrites it and a load
lands before attention reads it. Host blocks are locked (ref count) while a transfer involving
them is in flight, so host eviction never takes them.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from replicas.kv.block_pool import BlockPool
from replicas.kv.hashing import BlockHash
from replicas.kv.records import (
    EMPTY_MATCH,
    EMPTY_PART,
    BlockCopy,
    CacheStats,
    CacheTypeMatch,
    CacheTypeSpec,
    CacheTypeUsage,
    DiskCopy,
    PrefixMatch,
    TransferPlan,
)
from replicas.kv.events import (
    SLIDING,
    KVEvent,
    KVEventKind,
    KVSnapshot,
    Tier,
    safe_prefix_length,
)
from replicas.kv.retention import BlockCosts, RetentionStats, RetentionTracker
from replicas.kv.tiers import DiskIndex, TierLevel, order_tiers
from replicas.engine.request import Request

__all__ = ["EMPTY_MATCH", "CacheStats", "KVCacheManager", "PrefixMatch", "TransferPlan"]

ALL_TIERS = "all"
"""``reset_prefix_cache``'s choice of every tier."""

RETENTION_POLICIES = ("fixed", "adaptive")
"""``fixed``: the write-through threshold and write-back as configured; ``adaptive``: see
``replicas.kv.retention``."""

ONBOARD_TIMEOUT_MIN_S = 2.0
ONBOARD_TIMEOUT_FACTOR = 8.0
"""A waiting request stops waiting for its disk reads after ``max(ONBOARD_TIMEOUT_MIN_S,
ONBOARD_TIMEOUT_FACTOR x their predicted time)``."""


class ReloadCosts(NamedTuple):
    """The cost rule's inputs, seconds per block (``recompute_s`` 0 until measured, when the rule
    reads every disk prefix)."""

    recompute_s: float
    host_load_s: float
    disk_read_s: float


def reload_pays(
    num_blocks: int,
    num_disk_blocks: int,
    recompute_s: float,
    host_load_s: float,
    disk_read_s: float,
) -> bool:
    """The cost rule: whether loading ``num_blocks`` matched blocks, ``num_disk_blocks`` of them
    read from disk first, takes less time than computing them again (seconds per block)."""
    reload_s = num_disk_blocks * disk_read_s + num_blocks * host_load_s
    return reload_s < num_blocks * recompute_s


@dataclass(slots=True)
class _Onboarding:
    """A waiting request's disk reads: what it waits for and the host blocks it holds."""

    waiting: set[tuple[str, BlockHash]]  # (cache type, hash) not landed yet
    held: list[tuple[str, int]]  # (cache type, host block) referenced for it
    deadline: float


@dataclass(slots=True)
class _Reservation:
    """A waiting request's hold on its cached prefix: one reference per NPU block."""

    blocks: dict[str, list[int]]  # cache type -> NPU blocks held, in prompt order
    prefetched: dict[str, list[int]]  # cache type -> those loaded from host for it
    prefetched_hashes: frozenset[BlockHash]  # primary cache type's loaded blocks


@dataclass(slots=True)
class _CacheType:
    """One cache type: its tiers as an ordered list (``replicas.kv.tiers``: NPU, then host and
    disk when on), and each request's blocks. ``npu``, ``host`` and ``disk`` name the levels for
    the rules that move blocks between two particular tiers."""

    spec: CacheTypeSpec
    tiers: list[TierLevel]
    retention: RetentionTracker | None = None  # with a host tier
    blocks: dict[str, list[int | None]] = field(default_factory=dict)  # None: released
    num_cached: dict[str, int] = field(default_factory=dict)  # leading blocks hashed
    num_retained: dict[str, int] = field(default_factory=dict)  # leading blocks retained
    # Derived from ``tiers`` (kept in step by __post_init__ and add_tier), read on hot paths:
    pools: list[BlockPool] = field(init=False)  # the pooled tiers', in order
    npu: BlockPool = field(init=False)
    host: BlockPool | None = field(init=False)
    disk: DiskIndex | None = field(init=False)

    def __post_init__(self) -> None:
        self.tiers = order_tiers(self.tiers)
        self.pools = [level.pool for level in self.tiers if level.is_pooled]
        self.npu = self.tiers[0].pool
        host, disk = self.level(Tier.HOST), self.level(Tier.DISK)
        self.host = host.pool if host is not None else None
        self.disk = disk.store if disk is not None else None

    @property
    def name(self) -> str:
        return self.spec.name

    def level(self, tier: Tier) -> TierLevel | None:
        return next((level for level in self.tiers if level.tier == tier), None)

    def add_tier(self, level: TierLevel) -> None:
        self.tiers = [*self.tiers, level]
        self.__post_init__()

    def on_host(self, block_hash: BlockHash) -> bool:
        return self.host is not None and self.host.lookup(block_hash) is not None

    def in_pools(self, block_hash: BlockHash) -> bool:
        """Whether a tier whose blocks a request adopts directly (NPU, host) holds the block."""
        for pool in self.pools:  # noqa: SIM110 (a loop, not any(): called for every block)
            if pool.lookup(block_hash) is not None:
                return True
        return False

    def anywhere(self, block_hash: BlockHash) -> bool:
        """Whether any tier holds the block (disk included)."""
        return any(level.holds(block_hash) for level in self.tiers)

    def pool(self, tier: Tier) -> BlockPool | None:
        """The tier's block pool (None for a tier that is off, and for the disk tier, which is
        a store of files, not a pool)."""
        level = self.level(tier)
        return level.pool if level is not None else None

    def usage(self) -> CacheTypeUsage:
        counts = {level.tier: level.counts() for level in self.tiers}
        none = (0, 0, 0)
        disk = counts.get(Tier.DISK, none)
        retained = {level.tier: level.num_retained() for level in self.tiers[1:]}
        return CacheTypeUsage(
            *counts[Tier.NPU],
            *counts.get(Tier.HOST, none),
            disk[0],
            disk[2],
            retained.get(Tier.HOST, 0),
            retained.get(Tier.DISK, 0),
        )


class KVCacheManager:
    """Owns every cache type's pools and each request's block tables. Not thread-safe: one engine
    loop mutates it."""

    __slots__ = (
        "_by_name",
        "_cache_types",
        "_clock",
        "_disk_loads",
        "_disk_stores",
        "_events",
        "_host_load_s",
        "_inflight",
        "_loads",
        "_onboarding",
        "_recompute_s",
        "_record_events",
        "_reservations",
        "_stores",
        "block_size",
        "enable_prefix_caching",
        "onboard_timeout",
        "reservation_prefetch",
        "reservation_share",
        "retained_share",
        "retention",
        "stats",
        "write_back",
        "write_through_threshold",
    )  # no attribute is set from outside: events are turned on with enable_events()

    def __init__(
        self,
        num_npu_blocks: int = 0,
        block_size: int = 16,
        *,
        cache_types: list[CacheTypeSpec] | None = None,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        write_through_threshold: int | None = 2,
        write_back: bool = False,
        retention: str = "fixed",
        record_events: bool = False,
        reservation_share: float = 0.0,
        disk: dict[str, DiskIndex] | None = None,
        onboard_timeout: bool = True,
        reservation_prefetch: bool = True,
        retained_share: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= retained_share <= 1.0:
            raise ValueError(f"retained_share must be in [0, 1], got {retained_share}")
        if not 0.0 <= reservation_share <= 1.0:
            raise ValueError(f"reservation_share must be in [0, 1], got {reservation_share}")
        if retention not in RETENTION_POLICIES:
            raise ValueError(f"retention must be one of {RETENTION_POLICIES}, got {retention!r}")
        specs = cache_types or [CacheTypeSpec("full", num_npu_blocks, num_host_blocks)]
        if specs[0].sliding_window is not None:
            raise ValueError("the first cache type must be global attention")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.retained_share = retained_share
        self._clock = clock
        self._cache_types = [
            _CacheType(
                spec,
                [TierLevel(Tier.NPU, BlockPool(spec.num_npu_blocks, f"npu[{spec.name}]"))]
                + (
                    [
                        TierLevel(
                            Tier.HOST,
                            BlockPool(
                                spec.num_host_blocks,
                                f"host[{spec.name}]",
                                max_retained=int(retained_share * spec.num_host_blocks),
                                clock=clock,
                            ),
                        )
                    ]
                    if spec.num_host_blocks > 0
                    else []
                ),
            )
            for spec in specs
        ]
        self._by_name = {c.name: c for c in self._cache_types}
        has_host = all(c.host is not None for c in self._cache_types)
        if any(c.host is not None for c in self._cache_types) and not has_host:
            raise ValueError("every cache type needs host blocks when the host tier is on")
        self.write_through_threshold = write_through_threshold if has_host else None
        self.write_back = write_back and has_host
        self.retention = retention if has_host else "fixed"
        for cache_type in self._cache_types if has_host else ():
            cache_type.retention = RetentionTracker(
                cache_type.spec.num_host_blocks,
                self.write_back,
                adaptive=retention == "adaptive",
                promotion_threshold=self.write_through_threshold,
            )
        self._record_events = record_events  # see enable_events
        self.stats = CacheStats()
        self._events: list[KVEvent] = []  # since the last drain, for routers' prefix indexes
        self._stores: list[BlockCopy] = []
        self._loads: list[BlockCopy] = []
        self.reservation_share = reservation_share if enable_prefix_caching else 0.0
        self.reservation_prefetch = reservation_prefetch  # off: hold NPU blocks only
        self._reservations: dict[str, _Reservation] = {}  # oldest first
        if disk and not has_host:
            raise ValueError("the disk tier needs the host tier: disk blocks load through it")
        for cache_type in self._cache_types if disk else ():
            if cache_type.name not in disk:
                raise ValueError(f"the disk tier has no store for cache type {cache_type.name!r}")
            cache_type.add_tier(TierLevel(Tier.DISK, store=disk[cache_type.name]))
            cache_type.retention.behind_disk = True
        self._disk_stores: list[DiskCopy] = []
        self._disk_loads: list[DiskCopy] = []
        self._onboarding: dict[str, _Onboarding] = {}
        self._inflight: dict[tuple[str, BlockHash], tuple[int, set[str]]] = {}  # -> host, waiters
        self.onboard_timeout = onboard_timeout
        self._recompute_s: float | None = None  # measured seconds per block (set_block_costs)
        self._host_load_s = 0.0

    @property
    def npu(self) -> BlockPool:
        """The primary (global-attention) cache type's NPU pool, for tests and introspection;
        components read ``usage()`` instead."""
        return self._cache_types[0].npu

    @property
    def host(self) -> BlockPool | None:
        """The primary cache type's host pool (None without a host tier)."""
        return self._cache_types[0].host

    # ---- matching (no mutation) --------------------------------------------------------------
    def match_prefix(self, request: Request, max_blocks: int | None = None) -> PrefixMatch:
        """Longest safe cached prefix, in whole blocks, of at most ``max_blocks``; at least the
        request's last token is always left to compute."""
        if not self.enable_prefix_caching or max_blocks == 0:
            return EMPTY_MATCH
        limit = (request.num_tokens - 1) // self.block_size
        max_blocks = limit if max_blocks is None else min(max_blocks, limit)
        hashes = request.block_hashes[:max_blocks]
        primary = self._cache_types[0]
        length = 0
        for block_hash in hashes:
            if not primary.in_pools(block_hash):
                break
            length += 1
        for cache_type in self._cache_types[1:]:
            length = self._safe_length(cache_type, hashes, length)
        matches = {}
        for cache_type in self._cache_types:
            first = cache_type.spec.window_start(length * self.block_size, self.block_size)
            npu_ids = [cache_type.npu.lookup(h) for h in hashes[first:length]]
            host_ids = [
                cache_type.host.lookup(h) if cache_type.host else None for h in hashes[first:length]
            ]
            matches[cache_type.name] = CacheTypeMatch(first, npu_ids, host_ids)
        num_npu = sum(1 for b in matches[primary.name].npu_block_ids if b is not None)
        return PrefixMatch(length, num_npu, length - num_npu, matches)

    def _safe_length(self, cache_type: _CacheType, hashes: list[BlockHash], limit: int) -> int:
        """Longest ``L <= limit`` whose window of ``cache_type`` blocks is cached in either tier."""
        present = [cache_type.in_pools(h) for h in hashes[:limit]]
        return safe_prefix_length(present, limit, self.block_size, cache_type.spec.sliding_window)

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> dict[str, int]:
        """Free NPU blocks per cache type that ``allocate_slots`` would consume (no mutation)."""
        num_tokens = request.num_computed_tokens + match.num_blocks * self.block_size
        total = -(-(num_tokens + num_new_tokens) // self.block_size)
        needed = {}
        for cache_type in self._cache_types:
            held = len(cache_type.blocks.get(request.request_id, ()))
            part = match.cache_types.get(cache_type.name)
            adopted = revived = 0
            if part is not None:
                held = part.first_block  # released placeholders before the window
                adopted = sum(1 for b in part.npu_block_ids if b is not None)
                revived = sum(
                    1
                    for b in part.npu_block_ids
                    if b is not None and cache_type.npu.blocks[b].ref_count == 0
                )
            needed[cache_type.name] = total - held - adopted + revived
        return needed

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` tokens after its computed ones and, on
        its first allocation since admission or preemption, after the blocks of ``match``, which
        it adopts. Returns False, changing nothing, if any cache type lacks free NPU blocks."""
        if match.num_blocks and any(request.request_id in c.blocks for c in self._cache_types):
            raise ValueError(
                f"request {request.request_id} already holds blocks; cannot adopt a prefix match"
            )
        needed = self.num_blocks_needed(request, num_new_tokens, match)
        if any(needed[c.name] > c.npu.num_free for c in self._cache_types):
            return False
        if request.num_cached_tokens is None and self.enable_prefix_caching:
            self._observe_admission(request, match)  # before adoption changes residency
        num_tokens = request.num_computed_tokens + match.num_blocks * self.block_size
        num_total = -(-(num_tokens + num_new_tokens) // self.block_size)
        for cache_type in self._cache_types:
            blocks = cache_type.blocks.setdefault(request.request_id, [])
            if match.num_blocks:
                part = match.cache_types[cache_type.name]
                self._adopt(cache_type, request, blocks, part, match.num_blocks)
            if num_total > len(blocks):
                blocks.extend(self._allocate_npu(cache_type, num_total - len(blocks)))
        return True

    def _adopt(
        self,
        cache_type: _CacheType,
        request: Request,
        blocks: list[int | None],
        part: CacheTypeMatch,
        num_blocks: int,
    ) -> None:
        # Protect every matched block in both tiers before any allocation can evict one.
        npu_hits = [b for b in part.npu_block_ids if b is not None]
        host_hits = [h for n, h in zip(part.npu_block_ids, part.host_block_ids) if n is None]
        cache_type.npu.touch(npu_hits)
        if host_hits:
            cache_type.host.touch(host_hits)  # locked until their loads land
            if request.num_cached_tokens is None:
                for host_id in host_hits:
                    self._count_host_hit(cache_type, host_id)
        if request.num_cached_tokens is None:  # a new request, not a resumed one
            for npu_id in npu_hits:
                self._count_hit(cache_type, npu_id)
        blocks.extend([None] * part.first_block)
        for offset, npu_id in enumerate(part.npu_block_ids):
            if npu_id is None:
                block_hash = request.block_hashes[part.first_block + offset]
                (npu_id,) = self._allocate_npu(cache_type, 1)
                cache_type.npu.cache(npu_id, block_hash)
                self._loads.append(BlockCopy(part.host_block_ids[offset], npu_id, cache_type.name))
                self._emit(cache_type, KVEventKind.STORED, Tier.NPU, block_hash)
            blocks.append(npu_id)
        cache_type.num_cached[request.request_id] = num_blocks

    def _observe_admission(self, request: Request, match: PrefixMatch) -> None:
        """Show a new request's prompt blocks to each cache type's retention tracker (from its
        window's first block for a sliding cache type)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        for cache_type in self._cache_types:
            tracker = cache_type.retention
            if tracker is None:
                continue
            matched_tokens = match.num_blocks * self.block_size
            first = cache_type.spec.window_start(matched_tokens, self.block_size)
            hashes = request.block_hashes[first:max_blocks]
            npu, host = cache_type.npu, cache_type.host
            reservation = self._reservations.get(request.request_id)
            loaded = reservation.prefetched_hashes if reservation is not None else frozenset()
            tracker.admitted(
                hashes,
                [npu.lookup(h) is not None and h not in loaded for h in hashes],
                [host.lookup(h) is not None for h in hashes],
            )

    def _count_hit(self, cache_type: _CacheType, npu_id: int) -> None:
        num_hits = cache_type.npu.record_hit(npu_id)
        threshold = self.write_through_threshold
        if threshold and num_hits >= threshold:
            self._promote(cache_type, npu_id, cache_type.npu.blocks[npu_id].block_hash)

    def _count_host_hit(self, cache_type: _CacheType, host_id: int) -> None:
        """A new request reloads a host block: at the threshold, it is stored to disk too."""
        if cache_type.disk is None:
            return
        num_hits = cache_type.host.record_hit(host_id)
        threshold = self.write_through_threshold
        if threshold and num_hits >= threshold:
            self._store_to_disk(cache_type, host_id, cache_type.host.blocks[host_id].block_hash)

    def _store_to_disk(
        self,
        cache_type: _CacheType,
        host_id: int,
        block_hash: BlockHash,
        retained_until: float = 0.0,
    ) -> None:
        """Plan a copy of a host block to disk, unless the disk holds it; the host block stays
        locked until the copy has read it (``complete_transfer``). A retained block is kept
        on disk until ``retained_until``."""
        if block_hash is None or cache_type.disk.contains(block_hash):
            return
        cache_type.host.touch([host_id])
        copy = DiskCopy(host_id, block_hash, cache_type.name, retained_until=retained_until)
        self._disk_stores.append(copy)

    def _retain_on_disk(
        self, cache_type: _CacheType, host_id: int, block_hash: BlockHash, until: float
    ) -> None:
        """Retain a block on disk too: the disk's own copy, else a new one from its (landed)
        host block. A block another replica wrote stays that replica's to keep."""
        if cache_type.disk.contains(block_hash):
            cache_type.disk.retain(block_hash, until)
        else:
            self._store_to_disk(cache_type, host_id, block_hash, until)

    def _promote(self, cache_type: _CacheType, npu_id: int, block_hash: BlockHash) -> None:
        tracker = cache_type.retention
        if tracker is not None:
            tracker.promotion_candidate(block_hash)
            if tracker.adaptive:
                return  # stored when the NPU tier evicts it (RetentionTracker.should_store)
        if not cache_type.on_host(block_hash) and self._store(cache_type, npu_id, block_hash):
            self.stats.count_write_through_promotion(cache_type.name)

    def _allocate_npu(self, cache_type: _CacheType, num_blocks: int) -> list[int]:
        block_ids, evicted = cache_type.npu.allocate(num_blocks)
        tracker = cache_type.retention
        for npu_id, block_hash in evicted:
            self.stats.count_npu_eviction(cache_type.name)
            self._emit(cache_type, KVEventKind.REMOVED, Tier.NPU, block_hash)
            if tracker is None:
                continue
            num_hits = cache_type.npu.blocks[npu_id].num_hits  # kept until cached again
            kept = cache_type.on_host(block_hash)
            if not kept:
                host_full = cache_type.host.num_cached >= cache_type.host.num_blocks
                if tracker.should_store(block_hash, num_hits, host_full):
                    kept = self._store(cache_type, npu_id, block_hash)
                    if kept:
                        self.stats.count_write_back(cache_type.name)
                if tracker.adaptive:
                    tracker.adaptive_decision(kept)
            tracker.npu_evicted(block_hash, num_hits, kept)
        return block_ids

    def _store(self, cache_type: _CacheType, npu_id: int, block_hash: BlockHash) -> bool:
        """Plan a copy of an NPU block to a new host block; False if every host block is locked."""
        if cache_type.host.num_free == 0:
            return False
        host_id = self._allocate_host(cache_type)  # locked until the store lands
        cache_type.host.cache(host_id, block_hash)
        self._stores.append(BlockCopy(npu_id, host_id, cache_type.name))
        self._emit(cache_type, KVEventKind.STORED, Tier.HOST, block_hash)
        return True

    def _allocate_host(self, cache_type: _CacheType) -> int:
        """One host block (ref count 1), evicting the least recently used cached one if
        needed, after planning its write-back to disk when a disk tier is on."""
        if cache_type.disk is not None:
            self._write_back_to_disk(cache_type)
        (host_id,), evicted = cache_type.host.allocate(1)
        for _, old_hash in evicted:
            self.stats.count_host_eviction(cache_type.name)
            self._emit(cache_type, KVEventKind.REMOVED, Tier.HOST, old_hash)
            cache_type.retention.host_evicted(old_hash)
        return host_id

    def _write_back_to_disk(self, cache_type: _CacheType) -> None:
        """Before host allocation evicts its next block, store that block to disk: always with
        write-back, as the adaptive policy decides with ``retention="adaptive"``, never else.
        The copy runs first in the plan, so it reads the block before this plan's store
        overwrites it."""
        if not (self.write_back or self.retention == "adaptive"):
            return
        host = cache_type.host
        host.expire()  # as allocation will: the block it takes next
        host_id = host.next_to_allocate()
        block_hash = host.blocks[host_id].block_hash if host_id is not None else None
        if block_hash is None or cache_type.disk.contains(block_hash):
            return
        if not self.write_back:
            disk_read_s = cache_type.disk.read_seconds_per_block()
            if not cache_type.retention.disk_write_back_pays(disk_read_s):
                self.stats.disk_write_back_skips += 1
                return
        self._disk_stores.append(DiskCopy(host_id, block_hash, cache_type.name, locked=False))

    # ---- the disk tier -------------------------------------------------------------------------
    @property
    def has_disk(self) -> bool:
        return self._cache_types[0].disk is not None

    @property
    def num_onboarding(self) -> int:
        """Waiting requests whose disk reads have not all landed."""
        return sum(1 for o in self._onboarding.values() if o.waiting)

    def onboard(self, request: Request, max_blocks: int | None = None) -> bool:
        """Whether a waiting request must wait for disk reads (mutates): reads are planned the
        first time the disk holds blocks past its match and ``reload_pays``; True until they
        land or time out."""
        if not self.has_disk or not self.enable_prefix_caching:
            return False
        onboarding = self._onboarding.get(request.request_id)
        if onboarding is not None:
            if not onboarding.waiting:
                return False
            if self.onboard_timeout and time.monotonic() > onboarding.deadline:
                self.stats.disk_load_timeouts += 1
                onboarding.waiting.clear()
                return False
            return True
        if request.num_cached_tokens is not None:  # resumed after preemption: not new traffic
            return False
        match = self.match_prefix(request, max_blocks)
        plan = self._disk_extension(request, match.num_blocks, max_blocks)
        if plan is None:  # decided once per request: later steps skip the lookups
            self._onboarding[request.request_id] = _Onboarding(set(), [], 0.0)
            return False
        length, reads = plan
        for cache_type in self._cache_types:  # host blocks to read into: asked again later
            new = [h for h in reads[cache_type.name] if (cache_type.name, h) not in self._inflight]
            if len(new) > cache_type.host.num_free:
                return False
        num_disk = sum(len(r) for r in reads.values())
        primary = self._cache_types[0]
        disk_read_s = primary.disk.read_seconds_per_block()
        recompute_s = self._recompute_s
        if recompute_s is not None and not reload_pays(
            length - match.num_blocks, num_disk, recompute_s, self._host_load_s, disk_read_s
        ):
            self.stats.disk_recomputes += 1
            self._onboarding[request.request_id] = _Onboarding(set(), [], 0.0)
            return False
        self.stats.disk_reloads += 1
        waiting: set[tuple[str, BlockHash]] = set()
        held: list[tuple[str, int]] = []
        for cache_type in self._cache_types:
            for block_hash in reads[cache_type.name]:
                key = (cache_type.name, block_hash)
                inflight = self._inflight.get(key)
                if inflight is None:
                    host_id = self._allocate_host(cache_type)
                    cache_type.host.touch([host_id])  # the read's reference and the waiter's
                    inflight = self._inflight[key] = (host_id, set())
                    self._disk_loads.append(DiskCopy(host_id, block_hash, cache_type.name))
                else:
                    cache_type.host.touch([inflight[0]])  # the waiter's reference
                inflight[1].add(request.request_id)
                waiting.add(key)
                held.append((cache_type.name, inflight[0]))
        predicted = num_disk * disk_read_s
        deadline = time.monotonic() + max(ONBOARD_TIMEOUT_MIN_S, ONBOARD_TIMEOUT_FACTOR * predicted)
        self._onboarding[request.request_id] = _Onboarding(waiting, held, deadline)
        return True

    def _disk_extension(
        self, request: Request, num_matched: int, max_blocks: int | None
    ) -> tuple[int, dict[str, list[BlockHash]]] | None:
        """The longest safe prefix with disk blocks counted, and per cache type the blocks of
        it that only the disk holds; None when the disk adds nothing (no mutation)."""
        limit = (request.num_tokens - 1) // self.block_size
        limit = limit if max_blocks is None else min(limit, max_blocks)
        hashes = request.block_hashes[:limit]
        primary = self._cache_types[0]
        length = num_matched
        while length < len(hashes) and primary.anywhere(hashes[length]):
            length += 1
        for cache_type in self._cache_types[1:]:
            present = [cache_type.anywhere(h) for h in hashes[:length]]
            length = safe_prefix_length(
                present, length, self.block_size, cache_type.spec.sliding_window
            )
        if length <= num_matched:
            return None
        reads = {}
        for cache_type in self._cache_types:
            first = cache_type.spec.window_start(length * self.block_size, self.block_size)
            reads[cache_type.name] = [h for h in hashes[first:length] if not cache_type.in_pools(h)]
        return length, reads

    def complete_disk_loads(self, results: list[tuple[DiskCopy, bool]]) -> None:
        """Record disk reads that ended: a valid block is cached in its host block; a miss frees
        the host block and the disk forgets the block."""
        by_name = self._by_name
        for copy, ok in results:
            cache_type = by_name[copy.cache_type]
            key = (copy.cache_type, copy.block_hash)
            host_id, waiters = self._inflight.pop(key)
            host = cache_type.host
            if ok and host.cache(host_id, copy.block_hash):
                self.stats.disk_blocks_loaded += 1
                self._emit(cache_type, KVEventKind.STORED, Tier.HOST, copy.block_hash)
            else:
                self.stats.disk_load_failures += not ok
                if not ok:
                    cache_type.disk.discard(copy.block_hash)
            for request_id in waiters:
                onboarding = self._onboarding.get(request_id)
                if onboarding is not None:
                    onboarding.waiting.discard(key)
            host.free([host_id])  # the read's own reference; waiters hold theirs

    def _end_onboarding(self, request_id: str) -> None:
        onboarding = self._onboarding.pop(request_id, None)
        if onboarding is None:
            return
        by_name = self._by_name
        for name, host_id in onboarding.held:
            by_name[name].host.free([host_id])
        for key in onboarding.waiting:
            inflight = self._inflight.get(key)
            if inflight is not None:
                inflight[1].discard(request_id)

    # ---- reservations ------------------------------------------------------------------------
    def has_reservation(self, request_id: str) -> bool:
        return request_id in self._reservations

    def reserve(self, request: Request) -> bool:
        """Hold a waiting request's cached prefix and prefetch its host-only blocks (mutates),
        within ``reservation_share`` of each cache type's NPU blocks; a prefix that does not fit
        is held as far as its halves do. False when nothing was reserved."""
        if not self.reservation_share or request.request_id in self._reservations:
            return False
        if any(request.request_id in c.blocks for c in self._cache_types):
            raise ValueError(f"request {request.request_id} holds blocks: it is not waiting")
        match = self.match_prefix(request)
        while not self.reservation_prefetch and (run := _npu_run(match)) < match.num_blocks:
            match = self.match_prefix(request, run)
        while match.num_blocks and not self._fits(match):
            match = self.match_prefix(request, match.num_blocks // 2)
        if not match.num_blocks:
            return False
        blocks: dict[str, list[int]] = {}
        prefetched: dict[str, list[int]] = {}
        for cache_type in self._cache_types:
            part = match.cache_types[cache_type.name]
            hits = [b for b in part.npu_block_ids if b is not None]
            cache_type.npu.touch(hits)
            held, loaded = [], []
            for offset, npu_id in enumerate(part.npu_block_ids):
                if npu_id is None:
                    block_hash = request.block_hashes[part.first_block + offset]
                    host_id = part.host_block_ids[offset]
                    cache_type.host.touch([host_id])  # locked until its load lands
                    self._count_host_hit(cache_type, host_id)
                    (npu_id,) = self._allocate_npu(cache_type, 1)
                    cache_type.npu.cache(npu_id, block_hash)
                    self._loads.append(BlockCopy(host_id, npu_id, cache_type.name, True))
                    self._emit(cache_type, KVEventKind.STORED, Tier.NPU, block_hash)
                    loaded.append(npu_id)
                held.append(npu_id)
            blocks[cache_type.name] = held
            prefetched[cache_type.name] = loaded
        primary = self._cache_types[0]
        hashes = frozenset(primary.npu.blocks[b].block_hash for b in prefetched[primary.name])
        self._reservations[request.request_id] = _Reservation(blocks, prefetched, hashes)
        self.stats.reservations += 1
        self.stats.reserved_blocks += len(blocks[primary.name])
        self.stats.prefetched_blocks += len(prefetched[primary.name])
        return True

    def _fits(self, match: PrefixMatch) -> bool:
        """Whether reserving ``match`` keeps every cache type within its share of NPU blocks
        and leaves the free blocks its host-only blocks' loads need (no mutation)."""
        for cache_type in self._cache_types:
            part = match.cache_types[cache_type.name]
            npu = cache_type.npu
            num_loads = sum(1 for b in part.npu_block_ids if b is None)
            num_revived = sum(
                1 for b in part.npu_block_ids if b is not None and not npu.blocks[b].ref_count
            )
            held = sum(len(r.blocks[cache_type.name]) for r in self._reservations.values())
            limit = int(self.reservation_share * npu.num_blocks)
            if held + len(part.npu_block_ids) > limit or num_loads > npu.num_free - num_revived:
                return False
        return True

    def drop_reservation(self, keep: str | None = None) -> str | None:
        """Give way: drop the newest reservation (not ``keep``'s); returns its request id, None
        if there is none."""
        for request_id in reversed(self._reservations):
            if request_id != keep:
                self._release(self._reservations.pop(request_id))
                self.stats.reservations_dropped += 1
                return request_id
        return None

    def _release(
        self,
        reservation: _Reservation,
        used: PrefixMatch | None = None,
        request: Request | None = None,
    ) -> None:
        """Drop a reservation's references; count the prefetched blocks ``used`` adopted."""
        primary = self._cache_types[0].name
        if used is not None:
            adopted = set(used.cache_types.get(primary, EMPTY_PART).npu_block_ids)
            self.stats.prefetched_blocks_used += sum(
                1 for b in reservation.prefetched[primary] if b in adopted
            )
        for cache_type in self._cache_types:
            cache_type.npu.free(list(reversed(reservation.blocks[cache_type.name])))
        self.stats.reserved_blocks -= len(reservation.blocks[primary])

    # ---- after a forward pass ----------------------------------------------------------------
    def cache_blocks(self, request: Request) -> None:
        """Publish the request's newly full, computed blocks in each cache type's NPU hash map, then
        release sliding blocks that left the window."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for cache_type in self._cache_types:
            blocks = cache_type.blocks[request.request_id]
            start = cache_type.num_cached.get(request.request_id, 0)
            for i in range(start, num_full) if self.enable_prefix_caching else ():
                if blocks[i] is None:
                    continue
                block_hash = request.block_hashes[i]
                if cache_type.npu.cache(blocks[i], block_hash):
                    self._emit(cache_type, KVEventKind.STORED, Tier.NPU, block_hash)
                    if self.write_through_threshold == 0:
                        self._promote(cache_type, blocks[i], block_hash)
            cache_type.num_cached[request.request_id] = max(start, num_full)
            if request.num_retained_blocks and cache_type.host is not None:
                self._retain_prefix(cache_type, request, blocks)
            if cache_type.spec.sliding_window is not None:
                self._release_out_of_window(cache_type, request, blocks)

    def _retain_prefix(
        self, cache_type: _CacheType, request: Request, blocks: list[int | None]
    ) -> None:
        """Keep the request's retained prefix (``Request.num_retained_blocks``) in the host
        tier, and the disk tier when on, ahead of ordinary blocks for its lifetime from now:
        each newly cached block of it is stored to host if it has no host copy, and its host
        block is retained (a deadline already later is kept). Past the tier's
        ``retained_share``, the rest of the prefix stays ordinary."""
        rid = request.request_id
        start = cache_type.num_retained.get(rid, 0)
        end = min(request.num_retained_blocks, cache_type.num_cached.get(rid, 0))
        if end <= start:
            return
        until = self._clock() + request.retention_ttl_s
        host = cache_type.host
        # Host blocks whose store from NPU has not landed: their disk copy waits for it
        # (complete_transfer), since a plan's disk stores run before its NPU -> host stores.
        landing = {c.dst for c in self._stores if c.cache_type == cache_type.name}
        for i in range(start, end):
            npu_id = blocks[i] if i < len(blocks) else None
            block_hash = request.block_hashes[i]
            host_id = host.lookup(block_hash)
            if host_id is None and (npu_id is None or host.num_retained >= host.max_retained):
                continue  # nothing to store, or the share is full: it would stay ordinary
            if host_id is None and self._store(cache_type, npu_id, block_hash):
                host_id = host.lookup(block_hash)
                landing.add(host_id)
            if host_id is not None and host.retain(host_id, until):
                if cache_type.disk is not None and host_id not in landing:
                    self._retain_on_disk(cache_type, host_id, block_hash, until)
        cache_type.num_retained[rid] = end

    def _release_out_of_window(
        self, cache_type: _CacheType, request: Request, blocks: list[int | None]
    ) -> None:
        first_needed = cache_type.spec.window_start(request.num_computed_tokens, self.block_size)
        stale = [i for i in range(min(first_needed, len(blocks))) if blocks[i] is not None]
        if stale:
            cache_type.npu.free([blocks[i] for i in reversed(stale)])
            for i in stale:
                blocks[i] = None
            self.stats.count_blocks_freed_out_of_window(cache_type.name, len(stale))

    def free(self, request: Request) -> None:
        """Release every block of the request in every cache type, deepest first, and its
        reservation if it still waits."""
        reservation = self._reservations.pop(request.request_id, None)
        if reservation is not None:
            self._release(reservation)
        self._end_onboarding(request.request_id)
        for cache_type in self._cache_types:
            blocks = cache_type.blocks.pop(request.request_id, [])
            cache_type.num_cached.pop(request.request_id, None)
            cache_type.num_retained.pop(request.request_id, None)
            cache_type.npu.free([b for b in reversed(blocks) if b is not None])

    def expire_retained(self) -> None:
        """End the prompt-cache retentions whose lifetime has passed, in the host and disk
        tiers (mutates; once per engine step): their blocks are ordinary again, and the
        retained counts (``usage``) read this."""
        for cache_type in self._cache_types:
            for level in cache_type.tiers[1:]:
                level.expire_retained()

    def take_transfer_plan(self) -> TransferPlan:
        """The copies planned since the last call; the caller must run them, then call
        ``complete_transfer``."""
        plan = TransferPlan(
            self._stores, self._loads, tuple(self._disk_stores), tuple(self._disk_loads)
        )
        self._stores, self._loads = [], []
        self._disk_stores.clear()
        self._disk_loads.clear()
        return plan

    def complete_transfer(self, plan: TransferPlan) -> None:
        """Unlock the host blocks of a transfer that has landed."""
        by_name = self._by_name
        for copy in plan.disk_stores:
            self.stats.disk_blocks_stored += 1
            if copy.locked:
                by_name[copy.cache_type].host.free([copy.host_id])
        for copy in plan.stores:
            self.stats.count_block_stored(copy.cache_type)
            cache_type = by_name[copy.cache_type]
            cache_type.host.free([copy.dst])
            host_block = cache_type.host.blocks[copy.dst]
            if cache_type.disk is not None and host_block.retained_until:
                until = host_block.retained_until
                self._retain_on_disk(cache_type, copy.dst, host_block.block_hash, until)
            elif cache_type.disk is not None and self.write_through_threshold == 0:
                block_hash = cache_type.host.blocks[copy.dst].block_hash
                self._store_to_disk(cache_type, copy.dst, block_hash)
        for copy in plan.loads:
            self.stats.count_block_loaded(copy.cache_type)
            by_name[copy.cache_type].host.free([copy.src])
        for cache_type in self._cache_types:
            if cache_type.retention is not None:
                cache_type.retention.transfers_landed()

    # ---- accounting --------------------------------------------------------------------------
    def record_admission(self, request: Request, match: PrefixMatch) -> None:
        """Count a request's first lookup: queries are its prompt tokens, hits the matched (a
        block its reservation prefetched counts as the host hit it was). Ends its reservation:
        the request holds the blocks itself now."""
        onboarding = self._onboarding.get(request.request_id)
        from_disk = set(onboarding.held) if onboarding is not None else set()
        self._end_onboarding(request.request_id)
        reservation = self._reservations.pop(request.request_id, None)
        prefetched: dict[str, set[int]] = {}
        if reservation is not None:
            prefetched = {name: set(ids) for name, ids in reservation.prefetched.items()}
            self._release(reservation, used=match, request=request)
        if request.num_cached_tokens is not None:
            return
        primary = self._cache_types[0].name
        num_prefetched = sum(
            1
            for b in match.cache_types.get(primary, EMPTY_PART).npu_block_ids
            if b is not None and b in prefetched.get(primary, ())
        )
        request.num_npu_cached_tokens = (match.num_npu_blocks - num_prefetched) * self.block_size
        request.num_host_cached_tokens = (match.num_host_blocks + num_prefetched) * self.block_size
        request.num_cached_tokens = request.num_npu_cached_tokens + request.num_host_cached_tokens
        for name, part in match.cache_types.items():
            loaded = prefetched.get(name, ())
            num_npu = sum(1 for b in part.npu_block_ids if b is not None and b not in loaded)
            num_host = len(part.npu_block_ids) - num_npu
            request.cached_tokens_by_cache_type[name] = (
                num_npu * self.block_size,
                num_host * self.block_size,
            )
        self.stats.queries += request.num_prompt_tokens
        self.stats.hits += request.num_cached_tokens
        self.stats.npu_hits += request.num_npu_cached_tokens
        self.stats.host_hits += request.num_host_cached_tokens
        if from_disk:
            part = match.cache_types.get(primary, EMPTY_PART)
            num_disk = sum(
                1
                for n, h in zip(part.npu_block_ids, part.host_block_ids)
                if n is None and (primary, h) in from_disk
            )
            self.stats.disk_hits += num_disk * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in the primary cache type."""
        return self._cache_types[0].blocks.get(request_id, [])

    def block_tables(self, request_id: str) -> dict[str, list[int | None]]:
        """The request's blocks per cache type (None where a sliding block was released)."""
        return {c.name: c.blocks.get(request_id, []) for c in self._cache_types}

    def reset_prefix_cache(self, tier: Tier | str = ALL_TIERS) -> None:
        """Forget unreferenced cached blocks of ``tier`` ("all", "npu", "host" or "disk"; plain
        strings or ``Tier`` members) in every cache type, NPU before host before disk. The disk
        tier forgets this replica's own blocks; other replicas' stay theirs."""
        if tier != ALL_TIERS and tier not in tuple(Tier):
            raise ValueError(f"tier must be 'all', 'npu', 'host' or 'disk', got {tier!r}")
        tiers = tuple(Tier) if tier == ALL_TIERS else (Tier(tier),)
        for cache_type in self._cache_types:
            for level in cache_type.tiers:
                if level.tier not in tiers:
                    continue
                if level.pool is not None:
                    for _, block_hash in level.pool.evict_all_cached():
                        self._emit(cache_type, KVEventKind.REMOVED, level.tier, block_hash)
                elif hasattr(level.store, "clear"):  # its changes become disk events
                    level.store.clear()
            if Tier.HOST in tiers and cache_type.retention is not None:
                cache_type.retention.host_reset()

    # ---- views for the replica and its router ------------------------------------------------
    def usage(self) -> dict[str, CacheTypeUsage]:
        """Blocks per cache type and tier, the primary cache type first (no mutation)."""
        return {c.name: c.usage() for c in self._cache_types}

    def retention_stats(self) -> dict[str, RetentionStats]:
        """Ghost records, miss-ratio curve and adaptive decisions per cache type (empty without
        a host tier; no mutation)."""
        return {
            c.name: c.retention.snapshot(self.block_size)
            for c in self._cache_types
            if c.retention is not None
        }

    def reload_costs(self) -> ReloadCosts | None:
        """What ``reload_pays`` weighs now (None without a disk tier)."""
        disk = self._cache_types[0].disk
        if disk is None:
            return None
        return ReloadCosts(
            self._recompute_s or 0.0, self._host_load_s, disk.read_seconds_per_block()
        )

    def set_block_costs(self, costs: BlockCosts) -> None:
        """Measured seconds per block (recompute, reload, store), for the adaptive policy."""
        for cache_type in self._cache_types:
            if cache_type.retention is not None:
                cache_type.retention.set_costs(costs)
        self._recompute_s = costs.recompute_s
        self._host_load_s = costs.reload_s

    def num_free_npu_blocks(self) -> dict[str, int]:
        """NPU blocks each cache type can allocate now (empty or evictable)."""
        return {c.name: c.npu.num_free for c in self._cache_types}

    def enable_events(self) -> None:
        """Record KV events from now on, for ``drain_events`` (a replica that reports to a
        router); off unless the constructor's ``record_events`` turned it on. With a disk
        tier, the blocks the disk holds from before (a restart) are announced first."""
        self._record_events = True
        for cache_type in self._cache_types:
            track = getattr(cache_type.disk, "track_changes", None)
            if track is not None:
                track()

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last call, in order (mutates); the disk tier's follow
        (its writes land in the background, so their order among the others does not matter)."""
        events, self._events = self._events, []
        for cache_type in self._cache_types:
            drain = getattr(cache_type.disk, "drain_changes", None) if self._record_events else None
            for stored, block_hash in drain() if drain is not None else ():
                kind = KVEventKind.STORED if stored else KVEventKind.REMOVED
                events.append(KVEvent(kind, Tier.DISK, block_hash, cache_type.name))
        return events

    def snapshot(self, replica_index: int, next_seq: int) -> KVSnapshot:
        """Every hash each cache type holds, per tier, in the message a router resyncs from;
        ``next_seq`` is the sequence number of the replica's next event, so the caller drains
        and publishes pending events first (no mutation)."""
        by_tier = {
            c.name: {level.tier: tuple(level.cached_hashes()) for level in c.tiers}
            for c in self._cache_types
        }
        primary = by_tier[self._cache_types[0].name]
        sliding = by_tier.get(SLIDING, {})
        return KVSnapshot(
            replica_index,
            next_seq,
            primary[Tier.NPU],
            primary.get(Tier.HOST, ()),
            sliding.get(Tier.NPU, ()),
            sliding.get(Tier.HOST, ()),
            primary.get(Tier.DISK, ()),
        )

    def _emit(
        self, cache_type: _CacheType, kind: KVEventKind, tier: Tier, block_hash: BlockHash
    ) -> None:
        if self._record_events:
            self._events.append(KVEvent(kind, tier, block_hash, cache_type.name))

    def check_integrity(self) -> None:
        for cache_type in self._cache_types:
            for pool in cache_type.pools:
                pool.check_integrity()
            held: dict[int, int] = {}
            reserved = [r.blocks[cache_type.name] for r in self._reservations.values()]
            for blocks in [*cache_type.blocks.values(), *reserved]:
                for b in blocks:
                    if b is not None:
                        held[b] = held.get(b, 0) + 1
            for block in cache_type.npu.blocks:
                assert block.ref_count == held.get(block.block_id, 0), (
                    f"{cache_type.npu.name} block {block.block_id} ref_count {block.ref_count} but "
                    f"held {held.get(block.block_id, 0)} times"
                )


def _npu_run(match: PrefixMatch) -> int:
    """Leading blocks of ``match`` before the first one some cache type holds on host only."""
    run = match.num_blocks
    for part in match.cache_types.values():
        if None in part.npu_block_ids:
            run = min(run, part.first_block + part.npu_block_ids.index(None))
    return run
