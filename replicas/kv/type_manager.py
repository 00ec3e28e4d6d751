"""One cache type's manager: its pools and block tables, and the rules that move its blocks.

``KVCacheManager`` keeps one per cache type (a dense model has one, ``full``; a hybrid model adds
``sliding``). Each owns its ``CacheType`` (tiers and each request's blocks) and decides, for its
blocks alone, what NPU and host allocation evict, what is promoted to host and what new requests
adopt. The policies it consults are its own: the ``RetentionTracker`` of its host tier (what
write-back keeps), one ``BackingWrites`` per backing tier (what goes on to disk and any other
tier behind host) and ``PrefixRetention`` (prompt-cache lifetimes). Host retention (DESIGN
section 4):

  * write-through promotion: a *hit* is a new request matching an NPU-resident block (the write
    that created the block is not one). When a block's hits reach ``write_through_threshold``
    and it has no host copy, it is stored to host; ``immediate`` stores every block when it is
    first written, 0 never.
  * write-back: when allocation evicts an NPU-only cached block, it is stored to host first.
  * adaptive (``retention="adaptive"``): every store made at NPU eviction, as the policy
    decides from the reuse observed after earlier evictions (``replicas.kv.retention``).
"""

from collections.abc import Callable

from replicas.engine.request import Request
from replicas.kv.backing_writes import BackingRules, BackingWrites
from replicas.kv.block_pool import BlockClass, BlockPool, is_protected, protects_next
from replicas.kv.cache_type import CacheType, HostRules
from replicas.kv.events import Tier
from replicas.kv.hashing import BlockHash
from replicas.kv.hotness import HitWeights
from replicas.kv.journal import Journal
from replicas.kv.prompt_retention import PrefixRetention
from replicas.kv.records import BlockCopy, CacheTypeMatch
from replicas.kv.retention import IMMEDIATE, WriteThrough, hit_threshold
from replicas.kv.tenants import NO_TENANT
from replicas.kv.tiers import plugin


class CacheTypeManager:
    """One cache type's blocks across its tiers. Not thread-safe: one engine loop mutates it."""

    __slots__ = ("_block_size", "_journal", "_prompts", "_write_through", "backing", "cache_type")

    def __init__(
        self,
        cache_type: CacheType,
        journal: Journal,
        block_size: int,
        write_through: WriteThrough,
        backing: list[BackingWrites],
        prompts: PrefixRetention,
    ) -> None:
        self.cache_type = cache_type
        self.backing = backing  # one per backing tier, nearest first
        self._journal = journal
        self._block_size = block_size
        self._write_through = write_through
        self._prompts = prompts

    @property
    def name(self) -> str:
        return self.cache_type.name

    @property
    def npu(self) -> BlockPool:
        return self.cache_type.npu

    # ---- a new request's match ---------------------------------------------------------------
    def adopt(self, request: Request, part: CacheTypeMatch, num_blocks: int) -> None:
        """Give the request the matched blocks (``part`` of a ``num_blocks``-block match): NPU
        blocks directly, host blocks through a load into a new NPU block each."""
        cache_type = self.cache_type
        blocks = cache_type.blocks[request.request_id]
        # Protect every matched block in both tiers before any allocation can evict one.
        npu_ids, host_ids = part.block_ids(Tier.NPU), part.block_ids(Tier.HOST)
        npu_hits = [b for b in npu_ids if b is not None]
        host_hits = [h for n, h in zip(npu_ids, host_ids) if n is None]
        cache_type.npu.touch(npu_hits)
        is_new = request.num_cached_tokens is None  # a new request, not a resumed one
        if host_hits:
            cache_type.host.touch(host_hits)  # locked until their loads land
        if is_new and cache_type.host is not None:
            cache_type.host.mark(host_ids, request.batch, request.lifetime_s)
            for host_id in host_hits if is_new else ():
                self.count_host_hit(host_id)
        for npu_id in npu_hits if is_new else ():
            self._count_npu_hit(npu_id)
        blocks.extend([None] * part.first_block)
        for offset, npu_id in enumerate(npu_ids):
            if npu_id is None:
                block_hash = request.block_hashes[part.first_block + offset]
                npu_id = self.load(host_ids[offset], block_hash)
            blocks.append(npu_id)
        cache_type.num_cached[request.request_id] = num_blocks

    def load(self, host_id: int, block_hash: BlockHash, prefetch: bool = False) -> int:
        """Plan a load of a (locked) host block into a new NPU block, cached under its hash."""
        (npu_id,) = self.allocate_npu(1)
        tenant = self.cache_type.host.blocks[host_id].tenant
        self.cache_type.npu.cache(npu_id, block_hash, tenant)
        self._journal.plan.loads.append(BlockCopy(host_id, npu_id, self.name, prefetch))
        self._journal.stored(self.name, Tier.NPU, block_hash)
        return npu_id

    def observe_admission(
        self, request: Request, num_matched: int, prefetched: frozenset[BlockHash]
    ) -> None:
        """Show a new request's prompt blocks to the retention tracker (from its window's first
        block for a sliding cache type); ``prefetched``: blocks a reservation loaded for it."""
        tracker = self.cache_type.retention
        if tracker is None:
            return
        bs = self._block_size
        first = self.cache_type.spec.window_start(num_matched * bs, bs)
        hashes = request.block_hashes[first : (request.num_tokens - 1) // bs]
        npu, host = self.cache_type.npu, self.cache_type.host
        tracker.admitted(
            hashes,
            [npu.lookup(h) is not None and h not in prefetched for h in hashes],
            [host.lookup(h) is not None for h in hashes],
        )

    def count_host_hit(self, host_id: int) -> None:
        """A new request reloads a host block (the backing tiers' rules count it)."""
        if self.backing:
            num_hits = self.cache_type.host.record_hit(host_id)
            for writes in self.backing:
                writes.count_host_hit(host_id, num_hits)

    def writes_to(self, tier: str) -> BackingWrites:
        """The rules that store this cache type's host blocks to backing tier ``tier``."""
        return next(w for w in self.backing if w.tier == tier)

    def _count_npu_hit(self, npu_id: int) -> None:
        num_hits = self.cache_type.npu.record_hit(npu_id)
        threshold = hit_threshold(self._write_through)
        if threshold is not None and num_hits >= threshold:
            self._promote(npu_id, self.cache_type.npu.blocks[npu_id].block_hash)

    def _promote(self, npu_id: int, block_hash: BlockHash) -> None:
        tracker = self.cache_type.retention
        if tracker is not None:
            tracker.promotion_candidate(block_hash)
            if tracker.decides_at_eviction:
                return  # stored when the NPU tier evicts it (RetentionTracker.should_store)
        if not self.cache_type.on_host(block_hash) and self.store(npu_id, block_hash):
            self._journal.stats.count_write_through_promotion(self.name)

    # ---- allocation --------------------------------------------------------------------------
    def allocate_npu(self, num_blocks: int, batch: bool = False) -> list[int]:
        """NPU blocks, evicting cached ones as needed (each stored to host first when the host
        tier's policy keeps it, and, for a ``batch`` request, when an interactive session used
        it within its lifetime: a batch request moves such a block down a tier, never out)."""
        cache_type = self.cache_type
        classes: dict[int, BlockClass] = {}  # evicted blocks' tenants and classes, for stores
        block_ids, evicted = cache_type.npu.allocate(num_blocks, classes)
        tracker = cache_type.retention
        now = cache_type.npu.clock()
        for npu_id, block_hash in evicted:
            self._journal.stats.count_eviction(self.name, Tier.NPU)
            self._journal.removed(self.name, Tier.NPU, block_hash)
            if tracker is None:
                continue
            num_hits = cache_type.npu.blocks[npu_id].num_hits  # kept until cached again
            kept = cache_type.on_host(block_hash)
            if not kept:
                host_full = cache_type.host.num_cached >= cache_type.host.num_blocks
                protected = batch and is_protected(classes[npu_id], now)
                if tracker.should_store(block_hash, num_hits, host_full) or protected:
                    kept = self.store(npu_id, block_hash, classes[npu_id])
                    if kept:
                        self._journal.stats.count_write_back(self.name)
                if tracker.decides_at_eviction:
                    tracker.store_decided(kept)
            tracker.npu_evicted(block_hash, num_hits, kept)
        return block_ids

    def store(
        self, npu_id: int, block_hash: BlockHash, evicted_class: BlockClass | None = None
    ) -> bool:
        """Plan a copy of an NPU block to a new host block; False if every host block is locked,
        or if the block is a batch one and the host block it would take holds an interactive
        session's within its lifetime (``block_pool.protects_next``). The copy takes the NPU
        block's tenant and class (``evicted_class``: those it had before its eviction, which
        reset them)."""
        host_pool = self.cache_type.host
        npu = self.cache_type.npu.blocks[npu_id]
        tenant, batch, until = evicted_class or (npu.tenant, npu.batch, npu.interactive_until)
        if host_pool.num_free == 0 or (batch and protects_next(host_pool)):
            return False
        host_id = self.allocate_host()  # locked until the store lands
        host = host_pool.blocks[host_id]
        self.cache_type.host.cache(host_id, block_hash, tenant)
        host.batch, host.interactive_until = batch, until  # its class
        self._journal.plan.stores.append(BlockCopy(npu_id, host_id, self.name))
        self._journal.stored(self.name, Tier.HOST, block_hash)
        return True

    def allocate_host(self) -> int:
        """One host block (ref count 1), evicting the least recently used cached one if
        needed, after planning its write-back to each backing tier."""
        for writes in self.backing:
            writes.before_host_eviction()
        (host_id,), evicted = self.cache_type.host.allocate(1)
        for _, old_hash in evicted:
            self._journal.stats.count_eviction(self.name, Tier.HOST)
            self._journal.removed(self.name, Tier.HOST, old_hash)
            self.cache_type.retention.host_evicted(old_hash)
        return host_id

    # ---- after a forward pass ----------------------------------------------------------------
    def publish(self, request: Request, num_full: int, caching: bool) -> None:
        """Cache the request's newly full, computed blocks under their hashes (when ``caching``),
        retain its retained prefix, and release sliding blocks that left the window."""
        cache_type = self.cache_type
        rid = request.request_id
        blocks = cache_type.blocks[rid]
        start = cache_type.num_cached.get(rid, 0)
        for i in range(start, num_full) if caching else ():
            if blocks[i] is None:
                continue
            block_hash = request.block_hashes[i]
            tenant = request.tenant if i >= request.num_shared_blocks else NO_TENANT
            if cache_type.npu.cache(blocks[i], block_hash, tenant):
                self._journal.stored(self.name, Tier.NPU, block_hash)
                if self._write_through == IMMEDIATE:
                    self._promote(blocks[i], block_hash)
        cache_type.num_cached[rid] = max(start, num_full)
        if request.num_retained_blocks and cache_type.host is not None:
            self._prompts.retain(self, request, blocks)
        if cache_type.spec.sliding_window is not None:
            first_needed = cache_type.spec.window_start(
                request.num_computed_tokens, self._block_size
            )
            num_freed = cache_type.release_out_of_window(rid, first_needed)
            if num_freed:
                self._journal.stats.count_blocks_freed_out_of_window(self.name, num_freed)

    def store_landed(self, copy: BlockCopy) -> None:
        """An NPU -> host store landed: unlock its host block (and go on to the backing tiers
        by their rules)."""
        self._journal.stats.count_block_stored(self.name)
        self.cache_type.host.free([copy.dst])
        for writes in self.backing:
            writes.host_store_landed(copy.dst)

    def reset(self, tiers: tuple[Tier, ...]) -> None:
        """Forget the unreferenced cached blocks of ``tiers``, nearest first, announcing each."""
        for tier, block_hash in self.cache_type.reset(tiers):
            self._journal.removed(self.name, tier, block_hash)
        if Tier.HOST in tiers and self.cache_type.retention is not None:
            self.cache_type.retention.host_reset()

    def load_landed(self, copy: BlockCopy) -> None:
        """A host -> NPU load landed: unlock its host block."""
        self._journal.stats.count_block_loaded(self.name)
        self.cache_type.host.free([copy.src])


def build_managers(
    cache_types: list[CacheType],
    journal: Journal,
    block_size: int,
    host_rules: HostRules,
    weights: HitWeights,
    clock: Callable[[], float],
) -> list[CacheTypeManager]:
    """One manager per cache type, each with its own rules per backing tier and the
    prompt-cache retention they share; ``host_rules``: those in effect."""
    prompts = PrefixRetention(journal.plan, clock)
    tracker = cache_types[0].retention
    adaptive = tracker is not None and tracker.may_store_to_disk
    rules = BackingRules(host_rules.write_through_threshold, host_rules.write_back, adaptive)
    return [
        CacheTypeManager(
            c,
            journal,
            block_size,
            rules.write_through_threshold,
            [
                BackingWrites(c, b.tier, journal, rules, weights)
                for b in c.backing
                if plugin(b.tier).writable
            ],
            prompts,
        )
        for c in cache_types
    ]
