"""A pool of KV blocks of one tier: ref counts, the hash-to-block map and retention deadlines.

The pool holds no tensors; it decides which block ids hold what. Every block is in exactly one
of three states::

    in use   ref_count > 0            (running requests, or a transfer in flight)
    cached   ref_count == 0, hashed   (reusable by a later match; evictable)
    free     ref_count == 0, no hash  (holds nothing)

Free and cached blocks wait in the pool's ``FreeBlockQueue`` (``replicas.kv.free_block_queue``
owns the LRU order and draws it). Allocation takes blocks from its front, empty blocks first; a
cached block taken there is evicted (its hash leaves the map); released cached blocks go to the
back.

A request releases its blocks deepest first (``free(reversed(blocks))``), so among its blocks the
deepest are evicted before their parents and a surviving prefix stays a prefix.

**Kept blocks.** A free block that holds no hash but whose contents may still be read (a
request's partly computed last block, ``replicas.kv.partial_blocks``) is released with
``free(keep=...)`` into a queue of its own, which allocation takes from after the empty blocks
and before evicting any cached block: it lives on spare capacity only and never costs a cached
block its place. Once its contents have served (``keep_at_back``), it is released to the back of
the ordinary queue instead, and ages there as a cached block does.

**Batch and interactive** (``mark``; a request's class, from OpenAI's ``service_tier``). Every
block a request uses is marked with its class. An interactive use keeps the block out of the
batch class for ``interactive_lifetime_s`` from then; a batch use after that makes it a batch
block. Released, a cached batch block waits in a queue that allocation takes from after the
kept blocks and before any ordinary cached one: every batch block is evicted before an
interactive one. A host copy takes its NPU block's class when it is stored, and an interactive
hit's class when the request adopts it.

**Retention** (a priority class in eviction; the host tier's, DESIGN section 4). A cached block
may be *retained until* a deadline (``retain``). Released, it is ordered by the pool's
``retained_priority`` (``replicas.kv.free_block_queue`` draws both rules): ``decay`` (the
default), its priority decays over its lifetime, from behind every ordinary block just after
its release to an ordinary block at its true release time at its deadline; ``pin``, it waits in
a second LRU queue that allocation takes from only when the ordinary queue is empty, and re-enters
the ordinary queue at the back, as if just released, when its deadline passes. At most
``max_retained`` blocks are retained at once (the tier's ``retained_share``), so ordinary
traffic always has the rest.

Deadlines read ``clock`` (seconds, ``time.monotonic`` by default); expired retentions are
cleared before each allocation and by ``expire``.
"""

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from replicas.kv.free_block_queue import DECAY, RETAINED_PRIORITIES, FreeBlockQueue
from replicas.kv.hashing import BlockHash
from replicas.kv.keyed_heap import KeyedHeap
from replicas.kv.records import TierUsage
from replicas.kv.tenants import NO_TENANT, TenantQuotas

INTERACTIVE_LIFETIME_S = 300.0
"""How long an interactive request's use keeps a block out of the batch queue by default."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    num_hits: int = 0  # new requests that matched it since it was cached (kept after eviction)
    retained_until: float = 0.0  # a deadline on ``clock`` while retained, else 0
    batch: bool = False  # last used by a batch request, by no interactive one in its lifetime
    interactive_until: float = 0.0  # an interactive request's last use + its lifetime
    tenant: int = NO_TENANT  # whose cached block it is (``replicas.kv.tenants``)
    generation: int = 0  # allocations so far: its contents are a generation's (partial blocks)
    released: float = 0.0  # when it was last queued unreferenced, on the pool's ``clock``


BlockClass = tuple[int, bool, float]  # a block's tenant, batch, interactive_until


def is_protected(block_class: BlockClass, now: float) -> bool:
    """Whether a block of this class is an interactive session's within its lifetime: one a
    batch request never evicts from the cache (``TypeManager.allocate_npu``, ``store``)."""
    _, batch, interactive_until = block_class
    return not batch and interactive_until > now


class BlockPool:
    """Owns the blocks of one tier (a ``replicas.kv.tiers.TierStore``). Not thread-safe: one
    engine loop mutates it."""

    def __init__(
        self,
        num_blocks: int,
        name: str = "npu",
        *,
        max_retained: int = 0,
        clock: Callable[[], float] = time.monotonic,
        interactive_lifetime_s: float = INTERACTIVE_LIFETIME_S,
        retained_priority: str = DECAY,
    ) -> None:
        """``retained_priority``: how retained blocks are ordered in eviction, ``decay`` or
        ``pin`` (module docstring)."""
        if num_blocks < 1:
            raise ValueError(f"{name} pool needs at least one block, got {num_blocks}")
        if not 0 <= max_retained <= num_blocks:
            raise ValueError(f"{name} pool: max_retained must be in [0, {num_blocks}]")
        if retained_priority not in RETAINED_PRIORITIES:
            raise ValueError(
                f"{name} pool: retained_priority must be one of {RETAINED_PRIORITIES}, "
                f"got {retained_priority!r}"
            )
        self.name = name
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.quotas = TenantQuotas()  # blocks held per tenant, against their quotas
        # unreferenced blocks, in allocation order
        self._free_blocks = FreeBlockQueue(
            self.blocks, name, self.quotas, clock=clock, decay=retained_priority == DECAY
        )
        self._cached: dict[BlockHash, int] = {}
        self.max_retained = max_retained
        self.clock = clock
        self.interactive_lifetime_s = interactive_lifetime_s
        self.num_retained = 0  # blocks with a deadline, referenced or not
        self._deadlines = KeyedHeap()  # retained block ids by deadline

    # ---- queries (no mutation) ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (empty, kept, or evictable cached, retained
        included)."""
        return len(self._free_blocks)

    @property
    def num_empty(self) -> int:
        """Free blocks holding no hash: allocating up to this many evicts no cached block."""
        return self._free_blocks.num_empty

    @property
    def num_kept(self) -> int:
        """Free blocks kept for their contents (``free(keep=...)``)."""
        return self._free_blocks.num_kept

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Block id holding ``block_hash``, or None."""
        return self._cached.get(block_hash)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def usage(self) -> TierUsage:
        return TierUsage(self.num_blocks, self.num_used, self.num_cached, self.num_retained)

    def eviction_order(self) -> list[int]:
        """Block ids in the order allocation would take them (as of the last expiry)."""
        return self._free_blocks.order()

    def next_to_allocate(self) -> int | None:
        """The block id allocation would take next (None when none is free)."""
        return self._free_blocks.peek()

    # ---- mutation ----------------------------------------------------------------------------
    def allocate(
        self, num_blocks: int, classes: "dict[int, BlockClass] | None" = None
    ) -> tuple[list[int], list[tuple[int, BlockHash]]]:
        """Take ``num_blocks`` blocks from the front of the LRU queue, ref count 1 each.

        Returns the block ids and the ``(block_id, hash)`` of each cached block evicted to make
        room (the caller may still read those blocks' old contents before it overwrites them).
        ``classes``, when given, receives each evicted block's tenant and class as they were,
        by block id (a write-back's host copy keeps them).
        Raises ``MemoryError`` if fewer blocks are free; check ``num_free`` first.
        """
        if num_blocks > self.num_free:
            raise MemoryError(
                f"{self.name} pool: {num_blocks} blocks requested, {self.num_free} free"
            )
        if self.num_retained:
            self.expire()
        block_ids: list[int] = []
        evicted: list[tuple[int, BlockHash]] = []
        for _ in range(num_blocks):
            block_id = self._free_blocks.pop()
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append((block_id, block.block_hash))
                if classes is not None:
                    classes[block_id] = (block.tenant, block.batch, block.interactive_until)
                self._uncache(block)
            block.ref_count = 1
            block.batch, block.interactive_until = False, 0.0
            block.generation += 1
            block_ids.append(block_id)
        return block_ids, evicted

    def touch(self, block_ids: "list[int]") -> None:
        """Take a reference on cached or in-use blocks (a prefix hit), protecting them."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._free_blocks.remove(block)
            block.ref_count += 1

    def free(
        self, block_ids: "list[int]", keep: "Collection[int]" = (), keep_at_back: bool = False
    ) -> None:
        """Drop one reference per block, in the given order; blocks reaching zero are queued
        (cached ones at the back, empty ones at the front, but empty ones in ``keep``, whose
        contents may still be read, at the back of the kept queue: allocated after every empty
        block and before any cached one; with ``keep_at_back``, at the back of the ordinary
        queue instead, as a just-released cached block is: contents that just served)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"{self.name} block {block_id} freed with ref_count 0")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_blocks.push(block, block_id in keep, keep_at_back)

    def mark(
        self, block_ids: "Iterable[int | None]", batch: bool, lifetime_s: float | None = None
    ) -> None:
        """The blocks were used by a request of this class: an interactive use keeps them out
        of the batch queue for ``lifetime_s`` (the session's, ``replicas.kv.session_gaps``;
        None: ``interactive_lifetime_s``); a batch use after that puts them in it (``None``
        entries, a sliding window's released blocks, are skipped)."""
        now = self.clock()
        until = now + (self.interactive_lifetime_s if lifetime_s is None else lifetime_s)
        for block_id in block_ids:
            if block_id is None:
                continue
            block = self.blocks[block_id]
            was_batch = block.batch
            if batch:
                block.batch = block.interactive_until <= now
            else:
                block.batch, block.interactive_until = False, max(block.interactive_until, until)
            if block.ref_count == 0 and block.batch != was_batch:
                block.batch = was_batch
                self._free_blocks.remove(block)
                block.batch = not was_batch
                self._free_blocks.push(block, keep=False, keep_at_back=False)

    def discard_contents(self, block_id: int) -> None:
        """A kept block (``free(keep=...)``) whose contents are no longer wanted becomes an
        ordinary empty block, at the front of the queue."""
        block = self.blocks[block_id]
        if block.ref_count or block.block_hash is not None:
            return
        self._free_blocks.discard_contents(block_id)

    def cache(self, block_id: int, block_hash: BlockHash, tenant: int = NO_TENANT) -> bool:
        """Record that ``block_id`` holds ``block_hash``, ``tenant``'s block. Returns False (and
        records nothing) if another block already holds that hash or this block already holds
        one."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.tenant = tenant
        if tenant:
            self.quotas.cached(tenant)
        block.num_hits = 0
        self._cached[block_hash] = block_id
        return True

    def retain(self, block_id: int, until: float) -> bool:
        """Keep the cached block ahead of ordinary ones until ``until`` (on ``clock``; a later
        deadline extends it). False, changing nothing, when ``max_retained`` blocks are
        retained already or the block holds no hash."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            return False
        if not block.retained_until and self.num_retained >= self.max_retained:
            return False
        until = max(block.retained_until, until)
        if block.ref_count == 0:
            self._free_blocks.retain(block_id, until)  # its place, before the deadline moves
        if not block.retained_until:
            self.num_retained += 1
        block.retained_until = until
        self._deadlines.add(block_id, until)
        return True

    def expire(self) -> int:
        """Make every block whose deadline has passed ordinary again (mutates): an
        unreferenced one re-enters the ordinary queue at the back (pin) or at its release time
        (decay). Returns how many."""
        now = self.clock()
        num_expired = 0
        while (first := self._deadlines.first()) is not None and first[0] <= now:
            block_id = self._deadlines.take()
            block = self.blocks[block_id]
            block.retained_until = 0.0
            self.num_retained -= 1
            if block.ref_count == 0:
                self._free_blocks.unretain(block_id)
            num_expired += 1
        return num_expired

    def record_hit(self, block_id: int) -> int:
        """Count one more new request matching the cached block; returns its hits so far."""
        block = self.blocks[block_id]
        block.num_hits += 1
        return block.num_hits

    def evict_all_cached(self) -> list[tuple[int, BlockHash]]:
        """Forget every cached block nobody references (used to reset the prefix cache)."""
        evicted = []
        for block_id in self._free_blocks.release_cached():
            block = self.blocks[block_id]
            evicted.append((block_id, block.block_hash))
            self._uncache(block)
        return evicted

    def reset(self) -> list[BlockHash]:
        """``evict_all_cached``'s hashes (the ``TierStore`` reset: the caller announces them)."""
        return [block_hash for _, block_hash in self.evict_all_cached()]

    def _uncache(self, block: Block) -> None:
        del self._cached[block.block_hash]
        block.block_hash = None  # num_hits stays until the block is cached again
        if block.tenant:
            self.quotas.uncached(block.tenant)
            block.tenant = NO_TENANT
        if block.retained_until:
            block.retained_until = 0.0
            self.num_retained -= 1
            self._deadlines.pop(block.block_id)

    # ---- accounting --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached + in-use = total and all maps agree."""
        in_use = num_retained = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"{self.name} block {block.block_id} ref_count < 0"
            if block.ref_count > 0:
                in_use += 1
            if block.retained_until:
                num_retained += 1
                assert block.block_hash is not None, (
                    f"{self.name} block {block.block_id} retained without a hash"
                )
                deadline = (
                    self._deadlines.key(block.block_id)
                    if block.block_id in self._deadlines
                    else None
                )
                assert deadline == block.retained_until, (
                    f"{self.name} block {block.block_id} retained without its deadline"
                )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"{self.name} block {block.block_id} hash not mapped to it"
                )
        self._free_blocks.check_integrity()
        assert in_use + self.num_free == self.num_blocks, f"{self.name} blocks lost"
        assert num_retained == self.num_retained == len(self._deadlines) <= self.max_retained, (
            f"{self.name} retained {num_retained} blocks, counted {self.num_retained}, "
            f"at most {self.max_retained}"
        )
        assert len(self._cached) <= self.num_blocks, f"{self.name} hash map over capacity"
        held = Counter(b.tenant for b in self.blocks if b.block_hash is not None and b.tenant)
        assert held == +Counter(self.quotas.held), f"{self.name} blocks per tenant miscounted"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, (
                f"{self.name} hash map entry points to block {block_id} holding another hash"
            )


def protects_next(pool: BlockPool) -> bool:
    """Whether allocating a block of ``pool`` now would evict a cached block an interactive
    session used within its lifetime (``is_protected``)."""
    block_id = pool.next_to_allocate()
    if block_id is None or pool.blocks[block_id].block_hash is None:
        return False
    block = pool.blocks[block_id]
    return is_protected((block.tenant, block.batch, block.interactive_until), pool.clock())
