"""Which KV blocks each request uses, per cache type, across the tiers: the manager's facade.

The manager decides; it holds no tensors. Each engine step it hands a ``TransferPlan`` (host
blocks to load into NPU blocks, NPU blocks to store into host blocks, and the backing tiers'
copies) to the transfer component, which moves the bytes. The simulator drives this very class
with no tensors at all. It is a tree; each part owns its state and records what it does in the
manager's ``Journal`` (planned copies, events, counters)::

    KVCacheManager                 requests' lifecycle: match, allocate, publish, free, plans
    ├── PrefixMatcher              (replicas.kv.matching) what a request may reuse; no mutation
    ├── CacheTypeManager, per      (replicas.kv.type_manager) one cache type's pools and block
    │   cache type                 tables; eviction, promotion, stores; consults its policies:
    │   ├── RetentionTracker       (replicas.kv.retention) what the host tier keeps
    │   ├── BackingWrites, per     (replicas.kv.backing_writes) what goes on to each tier
    │   │   backing tier           behind host (disk, and any registered: replicas.kv.tiers)
    │   └── PrefixRetention        (replicas.kv.prompt_retention) prompt-cache lifetimes
    ├── Reservations               (replicas.kv.reservations) waiting requests' prefixes held
    ├── Onboarding                 (replicas.kv.onboarding) backing reads for waiting requests
    ├── PartialBlocks              (replicas.kv.partial_blocks) freed partial last blocks
    ├── HitWeights                 (replicas.kv.hotness) each block's recent hits
    └── CacheViews                 (replicas.kv.views) usage, snapshots, events, for readers

Cache types (``replicas.kv.cache_type``: residency per tier), the safe prefix of a hybrid model
(``replicas.kv.matching``) and a request's path through the tree are in ``docs/design.md``;
the order a plan's copies run in, in ``TransferPlan``.
"""

import time
from collections.abc import Callable, Mapping

from replicas.engine.request import Request
from replicas.kv.admission import count_admission
from replicas.kv.block_pool import INTERACTIVE_LIFETIME_S, BlockPool
from replicas.kv.cache_type import HostRules, build_cache_types, check_options
from replicas.kv.events import Tier
from replicas.kv.free_block_queue import DECAY
from replicas.kv.handover import WarmSource, WarmStart, WriteOut, hot_blocks
from replicas.kv.hashing import BlockHash
from replicas.kv.hotness import HitWeights
from replicas.kv.journal import Journal
from replicas.kv.matching import PrefixMatcher
from replicas.kv.onboarding import Onboarding
from replicas.kv.partial_blocks import PartialBlocks
from replicas.kv.records import (
    EMPTY_MATCH,
    BlockCopy,
    CacheStats,
    CacheTypeSpec,
    PrefixMatch,
    TransferPlan,
)
from replicas.kv.reservations import NO_RESERVATIONS, ReservationPolicy, Reservations
from replicas.kv.retention import BlockCosts, PolicyFactory, WriteThrough
from replicas.kv.tenant_curves import AutoQuotas
from replicas.kv.tenants import TenantTable, apply_quotas, quota_pools, slot_tenants
from replicas.kv.tiers import BackingStore
from replicas.kv.type_manager import build_managers
from replicas.kv.views import CacheViews

ALL_TIERS = "all"
"""``reset_prefix_cache``'s choice of every tier."""


class KVCacheManager:
    """The KV cache's facade (module docstring). Not thread-safe: one engine loop mutates it.
    Callers use its parts ``reservations``, ``onboarding`` (backing reads) and ``views`` directly;
    ``stats`` may be replaced (an engine resets it)."""

    def __init__(
        self,
        num_npu_blocks: int = 0,
        block_size: int = 16,
        *,
        cache_types: list[CacheTypeSpec] | None = None,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        write_through_threshold: WriteThrough = 2,
        write_back: bool = False,
        retention: "str | PolicyFactory" = "fixed",
        curve_sample_rate: float | None = None,
        reservations: ReservationPolicy = NO_RESERVATIONS,
        backing: dict[str, dict[str, BackingStore]] | None = None,
        retained_share: float = 0.25,
        retained_priority: str = DECAY,
        clock: Callable[[], float] = time.monotonic,
        reuse_partial_blocks: bool = False,
        interactive_lifetime_s: float = INTERACTIVE_LIFETIME_S,
    ) -> None:
        """``write_through_threshold``: as ``KVOffloadConfig``'s (``replicas.kv.retention``);
        ``backing``: per backing tier (``replicas.kv.tiers``), its store per cache type;
        ``retained_share``, ``retained_priority``: as ``KVOffloadConfig``'s (prompt-cache
        retention: how much of the host tier, ordered how, ``replicas.kv.free_block_queue``);
        ``clock`` (seconds) times prompt-cache retention and backing reads' deadlines;
        ``reuse_partial_blocks``: a freed block's computed tokens are copied for a request
        that continues them (``replicas.kv.partial_blocks``; dense models, prefix caching on);
        ``interactive_lifetime_s``: how long an interactive use keeps a block out of the batch
        class (``replicas.kv.block_pool``)."""
        check_options(retained_share, reservations.share, retention, retained_priority)
        specs = cache_types or [CacheTypeSpec("full", num_npu_blocks, num_host_blocks)]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        rules = HostRules(
            write_through_threshold, write_back, retention, curve_sample_rate, retained_priority
        )
        self._cache_types, rules = build_cache_types(specs, retained_share, clock, rules, backing)
        for pool in (p for c in self._cache_types for p in c.pools):
            pool.interactive_lifetime_s = interactive_lifetime_s
        self.tenants = TenantTable()  # salt -> tenant, the owner of each cached block
        self.auto_quotas: AutoQuotas | None = None  # tenant_quotas: auto, the quota pool's
        self.disk_quotas: AutoQuotas | None = None  # and the disk's own slots'
        self._clock = clock
        primary = self._cache_types[0]
        self._journal = journal = Journal()
        self._weights = HitWeights(sum(p.num_blocks for p in primary.pools), clock)
        parts = (journal, block_size, rules, self._weights, clock)
        self._managers = build_managers(self._cache_types, *parts)
        self._by_name = {m.name: m for m in self._managers}
        is_dense = len(self._cache_types) == 1
        reuse = reuse_partial_blocks and enable_prefix_caching and is_dense
        self._partial = PartialBlocks(primary.npu, block_size) if reuse else None
        matcher = PrefixMatcher(self._cache_types, block_size, enable_prefix_caching, self._partial)
        self._matcher = matcher
        if not enable_prefix_caching:
            reservations = reservations._replace(share=0.0)
        self.reservations = Reservations(self._managers, matcher, journal, reservations)
        self.onboarding = Onboarding(self._managers, matcher, journal, clock)
        self.views = CacheViews(self._cache_types, block_size, journal.events)

    @property
    def stats(self) -> CacheStats:
        return self._journal.stats

    @stats.setter
    def stats(self, stats: CacheStats) -> None:
        self._journal.stats = stats

    @property
    def npu(self) -> BlockPool:
        """The primary (global-attention) cache type's NPU pool, for tests and introspection;
        components read ``views.usage()`` instead."""
        return self._cache_types[0].npu

    @property
    def host(self) -> BlockPool | None:
        """The primary cache type's host pool (None without a host tier)."""
        return self._cache_types[0].host

    # ---- a request's blocks -------------------------------------------------------------------
    def match_prefix(self, request: Request, max_blocks: int | None = None) -> PrefixMatch:
        """The request's reusable cached prefix (``PrefixMatcher.match``; no mutation)."""
        return self._matcher.match(request, max_blocks)

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> dict[str, int]:
        """Free NPU blocks per cache type that ``allocate_slots`` would consume (no mutation)."""
        return self._matcher.num_blocks_needed(request, num_new_tokens, match)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` tokens after its computed ones and, on
        its first allocation since admission or preemption, after the blocks of ``match``, which
        it adopts. Returns False, changing nothing, if any cache type lacks free NPU blocks."""
        rid = request.request_id
        if match.num_blocks and any(rid in c.blocks for c in self._cache_types):
            raise ValueError(f"request {rid} already holds blocks; cannot adopt a prefix match")
        needed = self.num_blocks_needed(request, num_new_tokens, match)
        if match.tail is not None:
            if not self._partial.is_valid(match.tail):
                raise RuntimeError(f"request {rid}: its partial block was reused")
            if not self.npu.blocks[match.tail.block_id].ref_count:
                needed[self._cache_types[0].name] += 1  # the source, held until the copy
        if any(needed[c.name] > c.npu.num_free for c in self._cache_types):
            return False
        if request.num_cached_tokens is None and self.enable_prefix_caching:
            prefetched = self.reservations.prefetched_hashes(rid)
            for manager in self._managers:  # before adoption changes residency
                manager.observe_admission(request, match.num_blocks, prefetched)
            self._weights.hit(request.block_hashes[: match.num_blocks])
        num_tokens = request.num_computed_tokens + match.num_tokens(self.block_size)
        num_total = -(-(num_tokens + num_new_tokens) // self.block_size)
        if match.tail is not None:  # held before any allocation can overwrite it
            self._partial.hold(match.tail)
        for manager in self._managers:
            blocks = manager.cache_type.blocks.setdefault(rid, [])
            num_before = len(blocks)
            if match.num_blocks:
                manager.adopt(request, match.cache_types[manager.name], match.num_blocks)
            if num_total > len(blocks):
                blocks.extend(manager.allocate_npu(num_total - len(blocks), request.batch))
            manager.cache_type.npu.mark(blocks[num_before:], request.batch, request.lifetime_s)
            if match.tail is not None:
                copy = BlockCopy(match.tail.block_id, blocks[match.num_blocks], manager.name)
                self._journal.plan.block_copies.append(copy)
        return True

    def cache_blocks(self, request: Request) -> None:
        """After a forward pass: publish the request's newly full, computed blocks in each cache
        type's NPU hash map, then release sliding blocks that left the window."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for manager in self._managers:
            manager.publish(request, num_full, self.enable_prefix_caching)

    def free(self, request: Request) -> None:
        """Release every block of the request in every cache type, deepest first, and its
        reservation if it still waits."""
        self.reservations.end(request.request_id)
        self.onboarding.end(request.request_id)
        tail = None
        if self._partial is not None:
            tail = self._partial.tail_of(request, self.block_ids(request.request_id))
        for cache_type in self._cache_types:
            keep = (tail[1],) if tail else ()
            cache_type.free(request.request_id, keep, request.batch, request.lifetime_s)
        if tail is not None:
            self._partial.remember(*tail)

    def record_admission(self, request: Request, match: PrefixMatch) -> None:
        """Count a request's first lookup: queries are its prompt tokens, hits the matched (a
        block its reservation prefetched counts as the host hit it was). Ends its reservation:
        the request holds the blocks itself now."""
        read = self.onboarding.end(request.request_id)
        prefetched = self.reservations.end(request.request_id, used=match)
        if request.num_cached_tokens is None:
            primary = self._cache_types[0].name
            counts = (self.block_size, primary, prefetched, read)
            count_admission(self.stats, request, match, *counts)
            own = request.block_hashes[request.num_shared_blocks :]
            for quotas in (self.auto_quotas, self.disk_quotas):
                if quotas is not None:
                    quotas.observe(request.tenant, own)
            queries, hits = self.stats.by_tenant.get(request.tenant, (0, 0))
            self.stats.by_tenant[request.tenant] = (
                queries + request.num_prompt_tokens,
                hits + request.num_cached_tokens,
            )

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in the primary cache type."""
        return self._cache_types[0].blocks.get(request_id, [])

    def block_tables(self, request_id: str) -> dict[str, list[int | None]]:
        """The request's blocks per cache type (None where a sliding block was released)."""
        return {c.name: c.blocks.get(request_id, []) for c in self._cache_types}

    # ---- each engine step ---------------------------------------------------------------------
    def expire_retained(self) -> None:
        """End the prompt-cache retentions whose lifetime has passed, in every tier behind the
        NPU (mutates; once per engine step): their blocks are ordinary again, and the retained
        counts (``views.usage``) read this."""
        for cache_type in self._cache_types:
            cache_type.expire_retained()
        for quotas, tier in ((self.auto_quotas, "pool"), (self.disk_quotas, "disk")):
            shares = quotas.resize() if quotas is not None else None
            if shares is not None:
                apply_quotas(self._cache_types, shares, tiers=(tier,))

    def take_transfer_plan(self) -> TransferPlan:
        """The copies planned since the last call; the caller must run them (``block_copies``
        before the next forward pass), then call ``complete_transfer``."""
        plan = self._journal.plan.take()
        if self._partial is not None:
            self._partial.release_held()  # nothing allocated before the copies run
        return plan

    def complete_transfer(self, plan: TransferPlan) -> None:
        """Unlock the host blocks of a transfer that has landed."""
        for copy in plan.backing_stores:
            self._by_name[copy.cache_type].writes_to(copy.tier).store_landed(copy)
        for copy in plan.stores:
            self._by_name[copy.cache_type].store_landed(copy)
        for copy in plan.loads:
            self._by_name[copy.cache_type].load_landed(copy)
        for cache_type in self._cache_types:
            if cache_type.retention is not None:
                cache_type.retention.transfers_landed()

    def set_block_costs(self, costs: BlockCosts) -> None:
        """Measured seconds per block (recompute, reload, store), for the adaptive policy and
        the backing tiers' cost rule."""
        for cache_type in self._cache_types:
            if cache_type.retention is not None:
                cache_type.retention.set_costs(costs)
        self.onboarding.set_costs(costs.recompute_s, costs.reload_s)

    def reset_prefix_cache(self, tier: Tier | str = ALL_TIERS) -> None:
        """Forget unreferenced cached blocks of ``tier`` (a ``Tier`` or its name, or "all") in
        every cache type, nearest first; a shared tier (disk) forgets this replica's own blocks
        only."""
        if tier != ALL_TIERS and tier not in tuple(Tier):
            names = ", ".join(repr(t) for t in [ALL_TIERS, *(t.value for t in Tier)])
            raise ValueError(f"tier must be one of {names}, got {tier!r}")
        tiers = tuple(Tier) if tier == ALL_TIERS else (Tier(tier),)
        if self._partial is not None and Tier.NPU in tiers:
            self._partial.forget()
        for manager in self._managers:
            manager.reset(tiers)

    # ---- a resize's hand-over through the node's shared tier (disk) ----------------------------
    def hot_blocks(self) -> dict[BlockHash, float]:
        """The primary cache type's pooled blocks with their hit weights (a router's index)."""
        return hot_blocks(self._cache_types[0], self._weights)

    @property
    def handover_tier(self) -> str | None:
        """The tier a resize hands blocks over through (disk; ``CacheType.handover``)."""
        level = self._cache_types[0].handover
        return level.tier if level is not None else None

    def start_write_out(self) -> WriteOut:
        """The NPU and host blocks to write to the hand-over tier (disk), hottest first (none
        without one); the caller runs its rounds' plans, then ``end``s it."""
        return WriteOut(self._managers, self._weights)

    def start_warm(self, source: WarmSource | None = None) -> WarmStart:
        """Reads of the hand-over tier's (disk's) blocks into empty host blocks, hottest first
        (none without one), or of ``source``'s (none without its tier); the caller runs its
        rounds' plans."""
        return WarmStart(self._managers, self.onboarding, source)

    def set_tenant_quotas(self, shares: "Mapping[str, float] | str", min_share: float) -> None:
        """Each named tenant (salt) may hold its share of the quota tier's blocks (host, else
        NPU: ``replicas.kv.tenants.quota_pools``) before its blocks are evicted ahead of
        others', replacing earlier quotas; ``"auto"``: shares sized from the tenants' own
        curves, at least ``min_share`` each (``replicas.kv.tenant_curves``), sampled at the
        quota pool's capacity for it and at the disk's own slots for the disk's shares."""
        self.auto_quotas = self.disk_quotas = None
        if shares == "auto":
            capacity = sum(p.num_blocks for p in quota_pools(self._cache_types[:1]))
            self.auto_quotas = AutoQuotas(capacity, min_share)
            slots = sum(t.num_slots for t in slot_tenants(self._cache_types[:1]))
            self.disk_quotas = AutoQuotas(slots, min_share) if slots else None
            return
        apply_quotas(self._cache_types, {self.tenants.index(s): q for s, q in shares.items()})

    # ---- checks -------------------------------------------------------------------------------

    def num_free_npu_blocks(self) -> dict[str, int]:
        """NPU blocks each cache type can allocate now (empty or evictable)."""
        return {c.name: c.npu.num_free for c in self._cache_types}

    def check_integrity(self) -> None:
        for cache_type in self._cache_types:
            held = self.reservations.held_blocks(cache_type.name)
            if self._partial is not None and cache_type is self._cache_types[0]:
                held = [*held, self._partial.held]  # sources of copies not yet taken
            cache_type.check_integrity(held)
