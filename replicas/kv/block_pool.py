"""A pool of KV blocks of one tier: ref counts, the hash-to-block map and the LRU free queue.

The pool holds no tensors; it decides which block ids hold what. Every block is in exactly one
of three states::

    in use   ref_count > 0            (running requests, or a transfer in flight)
    cached   ref_count == 0, hashed   (reusable by a later match; evictable)
    free     ref_count == 0, no hash  (holds nothing)

Free and cached blocks wait in one LRU queue. Allocation takes blocks from its front; a cached
block taken there is evicted (its hash leaves the map). Empty blocks are queued at the front so
they are used before any cached block is evicted; released cached blocks go to the back::

    front (evicted first)                                            back (evicted last)
    | free ... free | cached, least recently released ... cached, just released |

A request releases its blocks deepest first (``free(reversed(blocks))``), so among its blocks the
deepest are evicted before their parents and a surviving prefix stays a prefix.

**Kept blocks.** A free block that holds no hash but whose contents may still be read (a
request's partly computed last block, ``replicas.kv.partial_blocks``) is released with
``free(keep=...)`` into a queue of its own, which allocation takes from after the empty blocks
and before evicting any cached block: it lives on spare capacity only and never costs a cached
block its place. Once its contents have served (``keep_at_back``), it is released to the back of
the ordinary queue instead, and ages there as a cached block does::

    | free ... free | kept, least recently released ... | cached (and served kept) ... |

**Retention** (a priority class in eviction; the host tier's, DESIGN section 4). A cached block
may be *retained until* a deadline (``retain``): released, it waits in a second LRU queue that
allocation takes from only when the ordinary queue is empty, so every ordinary block is evicted
before any retained one. At most ``max_retained`` blocks are retained at once (the tier's
``retained_share``), so ordinary traffic always has the rest. When its deadline passes, a
block is ordinary again and re-enters the ordinary queue at the back, as if just released::

    ordinary queue:  | free ... | cached, least recently released ... just released |  <- first
    retained queue:  | retained, least recently released ... just released |         <- then

Deadlines read ``clock`` (seconds, ``time.monotonic`` by default); expired retentions are
cleared before each allocation and by ``expire``.
"""

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from replicas.kv.hashing import BlockHash
from replicas.kv.records import TierUsage


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    num_hits: int = 0  # new requests that matched it since it was cached (kept after eviction)
    retained_until: float = 0.0  # a deadline on ``clock`` while retained, else 0
    generation: int = 0  # allocations so far: its contents are a generation's (partial blocks)


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
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"{name} pool needs at least one block, got {num_blocks}")
        if not 0 <= max_retained <= num_blocks:
            raise ValueError(f"{name} pool: max_retained must be in [0, {num_blocks}]")
        self.name = name
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.max_retained = max_retained
        self.clock = clock
        self.num_retained = 0  # blocks with a deadline, referenced or not
        self._retained_queue: OrderedDict[int, None] = OrderedDict()  # unreferenced, retained
        # Unreferenced, empty, but holding contents that may still be read (``free(keep=...)``):
        # allocated after the empty blocks, before any cached block is evicted.
        self._kept_queue: OrderedDict[int, None] = OrderedDict()
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped

    # ---- queries (no mutation) ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (empty, kept, or evictable cached, retained
        included)."""
        return len(self._free_queue) + len(self._kept_queue) + len(self._retained_queue)

    @property
    def num_empty(self) -> int:
        """Free blocks holding no hash: allocating up to this many evicts no cached block."""
        empty = sum(1 for b in self._free_queue if self.blocks[b].block_hash is None)
        return empty + len(self._kept_queue)

    @property
    def num_kept(self) -> int:
        """Free blocks kept for their contents (``free(keep=...)``)."""
        return len(self._kept_queue)

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
        ordinary = list(self._free_queue)
        num_empty = next(
            (i for i, b in enumerate(ordinary) if self.blocks[b].block_hash is not None),
            len(ordinary),
        )
        return [
            *ordinary[:num_empty],
            *self._kept_queue,
            *ordinary[num_empty:],
            *self._retained_queue,
        ]

    def next_to_allocate(self) -> int | None:
        """The block id allocation would take next (None when none is free)."""
        queue = self._next_queue()
        return next(iter(queue)) if queue else None

    def _next_queue(self) -> OrderedDict:
        """The queue allocation takes from next: empty blocks (at the front of the ordinary
        queue), then kept ones, then cached ones, retained ones last."""
        front = next(iter(self._free_queue), None)
        if front is not None and (self.blocks[front].block_hash is None or not self._kept_queue):
            return self._free_queue
        return self._kept_queue or self._retained_queue

    # ---- mutation ----------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> tuple[list[int], list[tuple[int, BlockHash]]]:
        """Take ``num_blocks`` blocks from the front of the LRU queue, ref count 1 each.

        Returns the block ids and the ``(block_id, hash)`` of each cached block evicted to make
        room (the caller may still read those blocks' old contents before it overwrites them).
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
            block_id, _ = self._next_queue().popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append((block_id, block.block_hash))
                self._uncache(block)
            block.ref_count = 1
            block.generation += 1
            block_ids.append(block_id)
        return block_ids, evicted

    def touch(self, block_ids: "list[int]") -> None:
        """Take a reference on cached or in-use blocks (a prefix hit), protecting them."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._queue_of(block).pop(block_id)
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
                if block.block_hash is None and block_id in keep:
                    (self._free_queue if keep_at_back else self._kept_queue)[block_id] = None
                    continue
                self._queue_of(block)[block_id] = None
                if block.block_hash is None:
                    self._free_queue.move_to_end(block_id, last=False)

    def discard_contents(self, block_id: int) -> None:
        """A kept block (``free(keep=...)``) whose contents are no longer wanted becomes an
        ordinary empty block, at the front of the queue."""
        block = self.blocks[block_id]
        if block.ref_count or block.block_hash is not None:
            return
        if block_id in self._kept_queue:
            del self._kept_queue[block_id]
            self._free_queue[block_id] = None
        if block_id in self._free_queue:
            self._free_queue.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that ``block_id`` holds ``block_hash``. Returns False (and records nothing) if
        another block already holds that hash or this block already holds one."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
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
        if block.retained_until:
            block.retained_until = max(block.retained_until, until)  # its heap entry follows
            return True
        if self.num_retained >= self.max_retained:
            return False
        self.num_retained += 1
        if block.ref_count == 0:
            del self._free_queue[block_id]
            self._retained_queue[block_id] = None
        block.retained_until = until
        heapq.heappush(self._deadlines, (until, block_id))
        if len(self._deadlines) > 2 * self.num_retained + 16:  # entries of evicted blocks
            self._deadlines = [
                (self.blocks[b].retained_until, b)
                for b in {b for _, b in self._deadlines if self.blocks[b].retained_until}
            ]
            heapq.heapify(self._deadlines)
        return True

    def expire(self) -> int:
        """Make every block whose deadline has passed ordinary again (mutates): an
        unreferenced one re-enters the ordinary queue at the back. Returns how many."""
        now = self.clock()
        num_expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            until, block_id = heapq.heappop(self._deadlines)
            block = self.blocks[block_id]
            if not block.retained_until:  # evicted since: no longer retained
                continue
            if block.retained_until > until:  # extended: one entry per block, moved on
                heapq.heappush(self._deadlines, (block.retained_until, block_id))
                continue
            if block.ref_count == 0:
                del self._retained_queue[block_id]
                self._free_queue[block_id] = None
            self._unretain(block)
            num_expired += 1
        return num_expired

    def _unretain(self, block: Block) -> None:
        block.retained_until = 0.0
        self.num_retained -= 1

    def _queue_of(self, block: Block) -> OrderedDict:
        if block.retained_until:
            return self._retained_queue
        return self._kept_queue if block.block_id in self._kept_queue else self._free_queue

    def record_hit(self, block_id: int) -> int:
        """Count one more new request matching the cached block; returns its hits so far."""
        block = self.blocks[block_id]
        block.num_hits += 1
        return block.num_hits

    def evict_all_cached(self) -> list[tuple[int, BlockHash]]:
        """Forget every cached block nobody references (used to reset the prefix cache)."""
        evicted = []
        for block_id in [*self._retained_queue, *self._free_queue]:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append((block_id, block.block_hash))
                self._uncache(block)
                self._free_queue[block_id] = None
                self._free_queue.move_to_end(block_id, last=False)
        self._retained_queue.clear()
        return evicted

    def reset(self) -> list[BlockHash]:
        """``evict_all_cached``'s hashes (the ``TierStore`` reset: the caller announces them)."""
        return [block_hash for _, block_hash in self.evict_all_cached()]

    def _uncache(self, block: Block) -> None:
        del self._cached[block.block_hash]
        block.block_hash = None  # num_hits stays until the block is cached again
        if block.retained_until:
            self._unretain(block)

    # ---- accounting --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached + in-use = total and all maps agree."""
        in_use = num_retained = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"{self.name} block {block.block_id} ref_count < 0"
            queued = (
                block.block_id in self._free_queue or block.block_id in self._kept_queue,
                block.block_id in self._retained_queue,
            )
            assert not (block.block_id in self._kept_queue and block.block_hash is not None), (
                f"{self.name} block {block.block_id} kept while cached"
            )
            if block.ref_count > 0:
                in_use += 1
                assert not any(queued), (
                    f"{self.name} block {block.block_id} in use but queued as free"
                )
            else:
                assert queued == (not block.retained_until, bool(block.retained_until)), (
                    f"{self.name} block {block.block_id} unreferenced but not in its queue"
                )
            if block.retained_until:
                num_retained += 1
                assert block.block_hash is not None, (
                    f"{self.name} block {block.block_id} retained without a hash"
                )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"{self.name} block {block.block_id} hash not mapped to it"
                )
        assert in_use + self.num_free == self.num_blocks, f"{self.name} blocks lost"
        assert num_retained == self.num_retained <= self.max_retained, (
            f"{self.name} retained {num_retained} blocks, counted {self.num_retained}, "
            f"at most {self.max_retained}"
        )
        assert len(self._cached) <= self.num_blocks, f"{self.name} hash map over capacity"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, (
                f"{self.name} hash map entry points to block {block_id} holding another hash"
            )
