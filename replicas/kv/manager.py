"""Which KV blocks each request uses, per cache type, across the tiers: matching, allocation and
freeing.

The manager decides; it holds no tensors. Each engine step it hands a ``TransferPlan`` (host
blocks to load into NPU blocks, NPU blocks to store into host blocks, and the disk tier's
copies) to the transfer component, which moves the bytes. The simulator drives this very class
with no tensors at all. Collaborators share its cache types and plan: ``Reservations``
(``replicas.kv.reservations``: waiting requests' prefixes held and prefetched),
``DiskOnboarding`` (``replicas.kv.onboarding``: the disk tier's reads and stores),
``CacheViews`` (``replicas.kv.views``: events, snapshots, usage), ``HitWeights``
(``replicas.kv.hotness``: each block's recent hits), ``PartialBlocks``
(``replicas.kv.partial_blocks``: freed requests' partly computed last blocks, copied for a
request that continues them) and the scaling hand-over through the disk tier
(``replicas.kv.handover``: ``WriteOut``, ``WarmStart``).

Cache types (``replicas.kv.cache_type``): a dense model has one, ``full``; a hybrid model adds
``sliding`` for its sliding-window layers. Each cache type has its own tiers and hash maps over
the same block hashes. Residency is derived from those maps, never kept in parallel flags::

    NPU only       h in the NPU map, not the host map    reusable now; lost on NPU eviction
    host only      h in the host map, not the NPU map    reload into a new NPU block first
    NPU and host   h in both maps                        reusable now; survives NPU eviction

Safe prefix (hybrid): ``L`` leading blocks are reusable only if global KV exists (either tier)
for all ``L`` and sliding KV exists (either tier) for the window ending at the match point::

    block:      0   1   2   3   4   5   6   7 | 8 ...      (L = 8, window spans blocks 6..7)
    full:       *   *   *   *   *   *   *   * |
    sliding:    -   -   -   -   -   -   *   * |            ("-" need not exist)

Sliding blocks that leave a running request's window are released at once (they stay cached).

Host retention policies (DESIGN section 4), per cache type, each a ``RetentionPolicy`` chosen
by name from the registry in ``replicas.kv.retention`` (or built by a factory passed in):
  * write-through promotion: a *hit* is a new request matching an NPU-resident block (the write
    that created the block is not one). When a block's hits reach ``write_through_threshold``
    and it has no host copy, it is stored to host. Threshold 0 stores every block when it is
    first written; ``None`` disables promotion.
  * write-back: when allocation evicts an NPU-only cached block, it is stored to host first.
  * adaptive (``retention="adaptive"``): every store made at NPU eviction: a block that reached
    the promotion threshold is stored then (not when it reached it), any other when the reuse
    observed after eviction pays for it at the measured costs (``replicas.kv.retention``).
Every cache type with a host tier also keeps ghost records and shadow host tiers
(``RetentionTracker``): ghost hits and the miss-ratio curve, whatever the policy, on a sample
of the block hashes (``curve_sample_rate``; None: about 1% of the host capacity in hashes).

Ordering: the transfer component runs a plan's stores before its loads and both before the
next forward pass, so a store reads an evicted block before new KV overwrites it and a load
lands before attention reads it. Host blocks are locked (ref count) while a transfer involving
them is in flight, so host eviction never takes them.
"""

import time
from collections.abc import Callable

from replicas.engine.request import Request
from replicas.kv.block_pool import BlockPool
from replicas.kv.cache_type import CacheType
from replicas.kv.events import KVEvent, KVEventKind, KVSnapshot, Tier
from replicas.kv.handover import WarmStart, WriteOut, hot_blocks
from replicas.kv.hashing import BlockHash
from replicas.kv.hotness import HitWeights
from replicas.kv.onboarding import DiskOnboarding, DiskRules, ReloadCosts, reload_pays
from replicas.kv.partial_blocks import PartialBlocks, parent_key
from replicas.kv.prompt_retention import PrefixRetention
from replicas.kv.records import (
    EMPTY_MATCH,
    EMPTY_PART,
    BlockCopy,
    CacheStats,
    CacheTypeMatch,
    CacheTypeSpec,
    CacheTypeUsage,
    DiskCopy,
    PlannedCopies,
    PrefixMatch,
    TransferPlan,
)
from replicas.kv.reservations import NO_RESERVATIONS, ReservationPolicy, Reservations
from replicas.kv.retention import (
    BlockCosts,
    PolicyContext,
    PolicyFactory,
    RetentionStats,
    RetentionTracker,
    policy_names,
)
from replicas.kv.tiers import DiskIndex, TierLevel
from replicas.kv.views import CacheViews, EventLog

__all__ = [
    "EMPTY_MATCH",
    "CacheStats",
    "KVCacheManager",
    "PrefixMatch",
    "ReloadCosts",
    "ReservationPolicy",
    "TransferPlan",
    "reload_pays",
]

ALL_TIERS = "all"
"""``reset_prefix_cache``'s choice of every tier."""


class KVCacheManager:
    """Owns every cache type's pools and each request's block tables. Not thread-safe: one engine
    loop mutates it. No attribute is set from outside but ``stats`` (an engine resets it)."""

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
        retention: "str | PolicyFactory" = "fixed",
        curve_sample_rate: float | None = None,
        reservations: ReservationPolicy = NO_RESERVATIONS,
        disk: dict[str, DiskIndex] | None = None,
        retained_share: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        reuse_partial_blocks: bool = False,
    ) -> None:
        """``clock`` (seconds) times prompt-cache retention and disk reads' deadlines;
        ``reuse_partial_blocks``: a freed block's computed tokens are copied for a request
        that continues them (``replicas.kv.partial_blocks``; dense models, prefix caching on)."""
        _check_options(retained_share, reservations, retention)
        specs = cache_types or [CacheTypeSpec("full", num_npu_blocks, num_host_blocks)]
        if specs[0].sliding_window is not None:
            raise ValueError("the first cache type must be global attention")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.retained_share = retained_share
        self._clock = clock
        self._cache_types = [_build_cache_type(spec, retained_share, clock) for spec in specs]
        self._by_name = {c.name: c for c in self._cache_types}
        has_host = all(c.host is not None for c in self._cache_types)
        if any(c.host is not None for c in self._cache_types) and not has_host:
            raise ValueError("every cache type needs host blocks when the host tier is on")
        self.write_through_threshold = write_through_threshold if has_host else None
        self.write_back = write_back and has_host
        self.retention = retention if has_host else "fixed"
        for cache_type in self._cache_types if has_host else ():
            context = PolicyContext(
                cache_type.spec.num_host_blocks, self.write_back, self.write_through_threshold
            )
            cache_type.retention = RetentionTracker(retention, context, curve_sample_rate)
        self.stats = CacheStats()
        self._plan = PlannedCopies()
        self._events = EventLog()  # off until enable_events
        self._views = CacheViews(self._cache_types, block_size, self._events)
        if not enable_prefix_caching:
            reservations = reservations._replace(share=0.0)
        # The collaborators share the cache types, the plan, the events and the counters.
        shared = (self._cache_types, block_size, self._plan, self._events, lambda: self.stats)
        adaptive = has_host and self._cache_types[0].retention.may_store_to_disk
        rules = DiskRules(self.write_through_threshold, self.write_back, adaptive)
        self._weights = HitWeights(sum(p.num_blocks for p in self._cache_types[0].pools), clock)
        self._disk = DiskOnboarding(
            *shared, rules, self.match_prefix, self._allocate_host, clock, self._weights
        )
        self._reservations = Reservations(
            *shared, reservations, self.match_prefix, self._allocate_npu, self._disk.count_host_hit
        )
        self._prefix_retention = PrefixRetention(self._plan, self._disk, self._store, clock)
        is_dense = len(self._cache_types) == 1
        self._partial = (
            PartialBlocks(self._cache_types[0].npu)
            if reuse_partial_blocks and enable_prefix_caching and is_dense
            else None
        )
        _add_disk(self._cache_types, disk or {}, has_host)

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
        """Longest safe cached prefix, in whole blocks, of at most ``max_blocks``, then (when
        the caller sets no limit) the tokens of a freed partial block that continue it; at
        least the request's last token is always left to compute."""
        if not self.enable_prefix_caching or max_blocks == 0:
            return EMPTY_MATCH
        is_limited = max_blocks is not None  # by the caller (prompt logprobs)
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
            length = cache_type.safe_length(hashes, length, self.block_size)
        matches = {c.name: c.match(hashes, length, self.block_size) for c in self._cache_types}
        match = PrefixMatch(length, matches[primary.name].num_blocks_by_source(), matches)
        if self._partial is None or is_limited:
            return match  # limited by the caller (prompt logprobs): whole blocks only
        start = length * self.block_size
        found = self._partial.find(
            parent_key(request.block_hashes, length, request.cache_salt),
            request.all_token_ids[start : min(start + self.block_size, request.num_tokens - 1)],
        )
        if found is None:
            return match
        return match._replace(tail=found[0], num_tail_tokens=found[1])

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> dict[str, int]:
        """Free NPU blocks per cache type that ``allocate_slots`` would consume (no mutation)."""
        num_tokens = request.num_computed_tokens + match.num_tokens(self.block_size)
        total = -(-(num_tokens + num_new_tokens) // self.block_size)
        return {
            c.name: c.num_blocks_needed(request.request_id, total, match.cache_types.get(c.name))
            for c in self._cache_types
        }

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
        if match.tail is not None:
            if not self._partial.is_valid(match.tail):
                raise RuntimeError(f"request {request.request_id}: its partial block was reused")
            if not self.npu.blocks[match.tail.block_id].ref_count:
                needed[self._cache_types[0].name] += 1  # the source, held until the copy
        if any(needed[c.name] > c.npu.num_free for c in self._cache_types):
            return False
        if request.num_cached_tokens is None and self.enable_prefix_caching:
            self._observe_admission(request, match)  # before adoption changes residency
            self._weights.hit(request.block_hashes[: match.num_blocks])
        num_tokens = request.num_computed_tokens + match.num_tokens(self.block_size)
        num_total = -(-(num_tokens + num_new_tokens) // self.block_size)
        if match.tail is not None:  # held before any allocation can overwrite it
            self._partial.hold(match.tail)
        for cache_type in self._cache_types:
            blocks = cache_type.blocks.setdefault(request.request_id, [])
            if match.num_blocks:
                part = match.cache_types[cache_type.name]
                self._adopt(cache_type, request, blocks, part, match.num_blocks)
            if num_total > len(blocks):
                blocks.extend(self._allocate_npu(cache_type, num_total - len(blocks)))
            if match.tail is not None:
                copy = BlockCopy(match.tail.block_id, blocks[match.num_blocks], cache_type.name)
                self._plan.block_copies.append(copy)
        return True

    def _adopt(
        self,
        cache_type: CacheType,
        request: Request,
        blocks: list[int | None],
        part: CacheTypeMatch,
        num_blocks: int,
    ) -> None:
        # Protect every matched block in both tiers before any allocation can evict one.
        npu_ids, host_ids = part.block_ids(Tier.NPU), part.block_ids(Tier.HOST)
        npu_hits = [b for b in npu_ids if b is not None]
        host_hits = [h for n, h in zip(npu_ids, host_ids) if n is None]
        cache_type.npu.touch(npu_hits)
        is_new = request.num_cached_tokens is None  # a new request, not a resumed one
        if host_hits:
            cache_type.host.touch(host_hits)  # locked until their loads land
            for host_id in host_hits if is_new else ():
                self._disk.count_host_hit(cache_type, host_id)
        for npu_id in npu_hits if is_new else ():
            self._count_hit(cache_type, npu_id)
        blocks.extend([None] * part.first_block)
        for offset, npu_id in enumerate(npu_ids):
            if npu_id is None:
                block_hash = request.block_hashes[part.first_block + offset]
                (npu_id,) = self._allocate_npu(cache_type, 1)
                cache_type.npu.cache(npu_id, block_hash)
                self._plan.loads.append(BlockCopy(host_ids[offset], npu_id, cache_type.name))
                self._events.emit(cache_type.name, KVEventKind.STORED, Tier.NPU, block_hash)
            blocks.append(npu_id)
        cache_type.num_cached[request.request_id] = num_blocks

    def _observe_admission(self, request: Request, match: PrefixMatch) -> None:
        """Show a new request's prompt blocks to each cache type's retention tracker (from its
        window's first block for a sliding cache type)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        loaded = self._reservations.prefetched_hashes(request.request_id)
        for cache_type in self._cache_types:
            tracker = cache_type.retention
            if tracker is None:
                continue
            matched_tokens = match.num_blocks * self.block_size
            first = cache_type.spec.window_start(matched_tokens, self.block_size)
            hashes = request.block_hashes[first:max_blocks]
            npu, host = cache_type.npu, cache_type.host
            tracker.admitted(
                hashes,
                [npu.lookup(h) is not None and h not in loaded for h in hashes],
                [host.lookup(h) is not None for h in hashes],
            )

    def _count_hit(self, cache_type: CacheType, npu_id: int) -> None:
        num_hits = cache_type.npu.record_hit(npu_id)
        threshold = self.write_through_threshold
        if threshold and num_hits >= threshold:
            self._promote(cache_type, npu_id, cache_type.npu.blocks[npu_id].block_hash)

    def _promote(self, cache_type: CacheType, npu_id: int, block_hash: BlockHash) -> None:
        tracker = cache_type.retention
        if tracker is not None:
            tracker.promotion_candidate(block_hash)
            if tracker.adaptive:
                return  # stored when the NPU tier evicts it (RetentionTracker.should_store)
        if not cache_type.on_host(block_hash) and self._store(cache_type, npu_id, block_hash):
            self.stats.count_write_through_promotion(cache_type.name)

    def _allocate_npu(self, cache_type: CacheType, num_blocks: int) -> list[int]:
        block_ids, evicted = cache_type.npu.allocate(num_blocks)
        tracker = cache_type.retention
        for npu_id, block_hash in evicted:
            self.stats.count_eviction(cache_type.name, Tier.NPU)
            self._events.emit(cache_type.name, KVEventKind.REMOVED, Tier.NPU, block_hash)
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

    def _store(self, cache_type: CacheType, npu_id: int, block_hash: BlockHash) -> bool:
        """Plan a copy of an NPU block to a new host block; False if every host block is locked."""
        if cache_type.host.num_free == 0:
            return False
        host_id = self._allocate_host(cache_type)  # locked until the store lands
        cache_type.host.cache(host_id, block_hash)
        self._plan.stores.append(BlockCopy(npu_id, host_id, cache_type.name))
        self._events.emit(cache_type.name, KVEventKind.STORED, Tier.HOST, block_hash)
        return True

    def _allocate_host(self, cache_type: CacheType) -> int:
        """One host block (ref count 1), evicting the least recently used cached one if
        needed, after planning its write-back to disk when a disk tier is on."""
        self._disk.before_host_eviction(cache_type)
        (host_id,), evicted = cache_type.host.allocate(1)
        for _, old_hash in evicted:
            self.stats.count_eviction(cache_type.name, Tier.HOST)
            self._events.emit(cache_type.name, KVEventKind.REMOVED, Tier.HOST, old_hash)
            cache_type.retention.host_evicted(old_hash)
        return host_id

    # ---- after a forward pass ----------------------------------------------------------------
    def cache_blocks(self, request: Request) -> None:
        """Publish the request's newly full, computed blocks in each cache type's NPU hash map, then
        release sliding blocks that left the window."""
        num_computed = request.num_computed_tokens
        num_full = min(num_computed // self.block_size, len(request.block_hashes))
        for cache_type in self._cache_types:
            blocks = cache_type.blocks[request.request_id]
            start = cache_type.num_cached.get(request.request_id, 0)
            for i in range(start, num_full) if self.enable_prefix_caching else ():
                if blocks[i] is None:
                    continue
                block_hash = request.block_hashes[i]
                if cache_type.npu.cache(blocks[i], block_hash):
                    self._events.emit(cache_type.name, KVEventKind.STORED, Tier.NPU, block_hash)
                    if self.write_through_threshold == 0:
                        self._promote(cache_type, blocks[i], block_hash)
            cache_type.num_cached[request.request_id] = max(start, num_full)
            if request.num_retained_blocks and cache_type.host is not None:
                self._prefix_retention.retain(cache_type, request, blocks)
            if cache_type.spec.sliding_window is not None:
                first_needed = cache_type.spec.window_start(num_computed, self.block_size)
                num_freed = cache_type.release_out_of_window(request.request_id, first_needed)
                if num_freed:
                    self.stats.count_blocks_freed_out_of_window(cache_type.name, num_freed)

    def free(self, request: Request) -> None:
        """Release every block of the request in every cache type, deepest first, and its
        reservation if it still waits."""
        self._reservations.end(request.request_id)
        self._disk.end(request.request_id)
        tail = self._partial_block_of(request)
        for cache_type in self._cache_types:
            cache_type.free(request.request_id, keep=(tail[1],) if tail else ())
        if tail is not None:
            self._partial.remember(*tail)

    def _partial_block_of(self, request: Request) -> tuple[bytes, int, list[int]] | None:
        """(its parent key, block id, token ids) of the request's partly computed last block,
        to remember once freed; None when there is none to reuse."""
        if self._partial is None:
            return None
        num_full, num_in_tail = divmod(request.num_computed_tokens, self.block_size)
        blocks = self._cache_types[0].blocks.get(request.request_id, [])
        if not num_in_tail or num_full >= len(blocks) or blocks[num_full] is None:
            return None
        if num_full > len(request.block_hashes):
            return None
        start = num_full * self.block_size
        token_ids = request.all_token_ids[start : start + num_in_tail]
        parent = parent_key(request.block_hashes, num_full, request.cache_salt)
        return parent, blocks[num_full], token_ids

    def expire_retained(self) -> None:
        """End the prompt-cache retentions whose lifetime has passed, in every tier behind the
        NPU (mutates; once per engine step): their blocks are ordinary again, and the retained
        counts (``usage``) read this."""
        for cache_type in self._cache_types:
            cache_type.expire_retained()

    def take_transfer_plan(self) -> TransferPlan:
        """The copies planned since the last call; the caller must run them (``block_copies``
        before the next forward pass), then call ``complete_transfer``."""
        plan = self._plan.take()
        if self._partial is not None:
            self._partial.release_held()  # nothing allocated before the copies run
        return plan

    def complete_transfer(self, plan: TransferPlan) -> None:
        """Unlock the host blocks of a transfer that has landed."""
        self._disk.disk_stores_landed(plan)
        for copy in plan.stores:
            self.stats.count_block_stored(copy.cache_type)
            cache_type = self._by_name[copy.cache_type]
            cache_type.host.free([copy.dst])
            self._disk.host_store_landed(cache_type, copy.dst)
        for copy in plan.loads:
            self.stats.count_block_loaded(copy.cache_type)
            self._by_name[copy.cache_type].host.free([copy.src])
        for cache_type in self._cache_types:
            if cache_type.retention is not None:
                cache_type.retention.transfers_landed()

    # ---- accounting --------------------------------------------------------------------------
    def record_admission(self, request: Request, match: PrefixMatch) -> None:
        """Count a request's first lookup: queries are its prompt tokens, hits the matched (a
        block its reservation prefetched counts as the host hit it was). Ends its reservation:
        the request holds the blocks itself now."""
        from_disk = self._disk.end(request.request_id)
        prefetched = self._reservations.end(request.request_id, used=match)
        if request.num_cached_tokens is None:
            primary = self._cache_types[0].name
            counts = (self.block_size, primary, prefetched, from_disk)
            _count_admission(self.stats, request, match, *counts)

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
        if self._partial is not None and Tier.NPU in tiers:
            self._partial.forget()
        for cache_type in self._cache_types:
            for level_tier, block_hash in cache_type.reset(tiers):
                self._events.emit(cache_type.name, KVEventKind.REMOVED, level_tier, block_hash)
            if Tier.HOST in tiers and cache_type.retention is not None:
                cache_type.retention.host_reset()

    # ---- the collaborators' interfaces (see their classes), as the engine and replica call them
    @property
    def reservation_share(self) -> float:
        return self._reservations.policy.share

    def reserve(self, request: Request) -> bool:
        return self._reservations.reserve(request)

    def has_reservation(self, request_id: str) -> bool:
        return self._reservations.has(request_id)

    def drop_reservation(self, keep: str | None = None) -> str | None:
        return self._reservations.drop_newest(keep)

    @property
    def has_disk(self) -> bool:
        return self._disk.is_on

    @property
    def num_onboarding(self) -> int:
        return self._disk.num_onboarding

    def onboard(self, request: Request, max_blocks: int | None = None) -> bool:
        if not self.has_disk or not self.enable_prefix_caching:
            return False
        return self._disk.onboard(request, max_blocks)

    def complete_disk_loads(self, results: list[tuple[DiskCopy, bool]]) -> None:
        self._disk.complete_loads(results)

    def reload_costs(self) -> ReloadCosts | None:
        return self._disk.reload_costs()

    def set_block_costs(self, costs: BlockCosts) -> None:
        """Measured seconds per block (recompute, reload, store), for the adaptive policy and
        the disk tier's cost rule."""
        for cache_type in self._cache_types:
            if cache_type.retention is not None:
                cache_type.retention.set_costs(costs)
        self._disk.set_costs(costs.recompute_s, costs.reload_s)

    def hot_blocks(self) -> dict[BlockHash, float]:
        return hot_blocks(self._cache_types[0], self._weights)

    def start_write_out(self) -> WriteOut:
        """The NPU and host blocks to write to the disk tier, hottest first (none without
        one); the caller runs its rounds' plans, then ``end``s it."""
        return WriteOut(self._cache_types, self._weights, self._disk, self._store)

    def start_warm(self) -> WarmStart:
        """Reads of the disk tier's blocks into empty host blocks, hottest first (none without
        a disk tier); the caller runs its rounds' plans."""
        return WarmStart(self._cache_types, self._disk)

    def usage(self) -> dict[str, CacheTypeUsage]:
        return self._views.usage()

    def retention_stats(self) -> dict[str, RetentionStats]:
        return self._views.retention_stats()

    def enable_events(self) -> None:
        self._views.enable_events()

    def drain_events(self) -> list[KVEvent]:
        return self._views.drain_events()

    def snapshot(self, replica_index: int, next_seq: int) -> KVSnapshot:
        return self._views.snapshot(replica_index, next_seq)

    def num_free_npu_blocks(self) -> dict[str, int]:
        """NPU blocks each cache type can allocate now (empty or evictable)."""
        return {c.name: c.npu.num_free for c in self._cache_types}

    def check_integrity(self) -> None:
        for cache_type in self._cache_types:
            held = self._reservations.held_blocks(cache_type.name)
            if self._partial is not None and cache_type is self._cache_types[0]:
                held = [*held, self._partial.held]  # sources of copies not yet taken
            cache_type.check_integrity(held)


def _check_options(
    retained_share: float, reservations: ReservationPolicy, retention: "str | PolicyFactory"
) -> None:
    if not 0.0 <= retained_share <= 1.0:
        raise ValueError(f"retained_share must be in [0, 1], got {retained_share}")
    if not 0.0 <= reservations.share <= 1.0:
        raise ValueError(f"reservation_share must be in [0, 1], got {reservations.share}")
    if not callable(retention) and retention not in policy_names():
        raise ValueError(f"retention must be one of {policy_names()}, got {retention!r}")


def _add_disk(cache_types: list[CacheType], disk: dict[str, DiskIndex], has_host: bool) -> None:
    """Put each cache type's disk store behind its host tier."""
    if disk and not has_host:
        raise ValueError("the disk tier needs the host tier: disk blocks load through it")
    for cache_type in cache_types if disk else ():
        if cache_type.name not in disk:
            raise ValueError(f"the disk tier has no store for cache type {cache_type.name!r}")
        cache_type.add_tier(TierLevel(Tier.DISK, store=disk[cache_type.name]))
        cache_type.retention.behind_disk = True


def _build_cache_type(
    spec: CacheTypeSpec, retained_share: float, clock: Callable[[], float]
) -> CacheType:
    """A cache type with its NPU tier and, with host blocks, its host tier."""
    levels = [TierLevel(Tier.NPU, BlockPool(spec.num_npu_blocks, f"npu[{spec.name}]"))]
    if spec.num_host_blocks > 0:
        host = BlockPool(
            spec.num_host_blocks,
            f"host[{spec.name}]",
            max_retained=int(retained_share * spec.num_host_blocks),
            clock=clock,
        )
        levels.append(TierLevel(Tier.HOST, host))
    return CacheType(spec, levels)


def _count_admission(
    stats: CacheStats,
    request: Request,
    match: PrefixMatch,
    block_size: int,
    primary: str,
    prefetched: dict[str, set[int]],
    from_disk: set[tuple[str, int]],
) -> None:
    """A new request's cached tokens per tier and cache type, on the request and in ``stats``:
    a block its reservation ``prefetched`` counts as the host hit it was, and the host blocks
    its disk reads filled (``from_disk``) as disk hits too."""
    bs = block_size
    primary_npu = match.cache_types.get(primary, EMPTY_PART).block_ids(Tier.NPU)
    loaded = prefetched.get(primary, ())
    num_prefetched = sum(1 for b in primary_npu if b is not None and b in loaded)
    request.num_npu_cached_tokens = (match.num_blocks_in(Tier.NPU) - num_prefetched) * bs
    request.num_npu_cached_tokens += match.num_tail_tokens
    request.num_host_cached_tokens = (match.num_blocks_in(Tier.HOST) + num_prefetched) * bs
    request.num_cached_tokens = request.num_npu_cached_tokens + request.num_host_cached_tokens
    for name, part in match.cache_types.items():
        loaded = prefetched.get(name, ())
        npu_ids = part.block_ids(Tier.NPU)
        num_npu = sum(1 for b in npu_ids if b is not None and b not in loaded)
        num_host = len(npu_ids) - num_npu
        num_tail = match.num_tail_tokens if name == primary else 0
        request.cached_tokens_by_cache_type[name] = (num_npu * bs + num_tail, num_host * bs)
    num_disk = 0
    if from_disk:
        part = match.cache_types.get(primary, EMPTY_PART)
        num_disk = sum(
            1
            for n, h in zip(part.block_ids(Tier.NPU), part.block_ids(Tier.HOST))
            if n is None and (primary, h) in from_disk
        )
    stats.queries += request.num_prompt_tokens
    stats.hits += request.num_cached_tokens
    stats.count_hits(Tier.NPU, request.num_npu_cached_tokens)
    stats.count_hits(Tier.HOST, request.num_host_cached_tokens - num_disk * bs)
    if num_disk:
        stats.count_hits(Tier.DISK, num_disk * bs)
