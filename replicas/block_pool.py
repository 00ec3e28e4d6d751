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
"""

from collections import OrderedDict
from dataclasses import dataclass

from replicas.hashing import BlockHash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    num_hits: int = 0  # new requests that matched it since it was cached (kept after eviction)


class BlockPool:
    """Owns the blocks of one tier. Not thread-safe: one engine loop mutates it."""

    def __init__(self, num_blocks: int, name: str = "npu") -> None:
        if num_blocks < 1:
            raise ValueError(f"{name} pool needs at least one block, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    # ---- queries (no mutation) ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (empty or evictable cached)."""
        return len(self._free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Block id holding ``block_hash``, or None."""
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def eviction_order(self) -> list[int]:
        """Block ids in the order allocation would take them."""
        return list(self._free_queue)

    def next_to_allocate(self) -> int | None:
        """The block id allocation would take next (None when none is free)."""
        return next(iter(self._free_queue), None)

    # ---- mutation ----------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> tuple[list[int], list[tuple[int, BlockHash]]]:
        """Take ``num_blocks`` blocks from the front of the LRU queue, ref count 1 each.

        Returns the block ids and the ``(block_id, hash)`` of each cached block evicted to make
        room (the caller may still read those blocks' old contents before it overwrites them).
        Raises ``MemoryError`` if fewer blocks are free; check ``num_free`` first.
        """
        if num_blocks > len(self._free_queue):
            raise MemoryError(
                f"{self.name} pool: {num_blocks} blocks requested, {len(self._free_queue)} free"
            )
        block_ids: list[int] = []
        evicted: list[tuple[int, BlockHash]] = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append((block_id, block.block_hash))
                self._uncache(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids, evicted

    def touch(self, block_ids: "list[int]") -> None:
        """Take a reference on cached or in-use blocks (a prefix hit), protecting them."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_queue[block_id]
            block.ref_count += 1

    def free(self, block_ids: "list[int]") -> None:
        """Drop one reference per block, in the given order; blocks reaching zero are queued
        (cached ones at the back, empty ones at the front)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"{self.name} block {block_id} freed with ref_count 0")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None
                if block.block_hash is None:
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

    def record_hit(self, block_id: int) -> int:
        """Count one more new request matching the cached block; returns its hits so far."""
        block = self.blocks[block_id]
        block.num_hits += 1
        return block.num_hits

    def evict_all_cached(self) -> list[tuple[int, BlockHash]]:
        """Forget every cached block nobody references (used to reset the prefix cache)."""
        evicted = []
        for block_id in list(self._free_queue):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append((block_id, block.block_hash))
                self._uncache(block)
                self._free_queue.move_to_end(block_id, last=False)
        return evicted

    def _uncache(self, block: Block) -> None:
        del self._cached[block.block_hash]
        block.block_hash = None  # num_hits stays until the block is cached again

    # ---- accounting --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached + in-use = total and all maps agree."""
        in_use = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"{self.name} block {block.block_id} ref_count < 0"
            if block.ref_count > 0:
                in_use += 1
                assert block.block_id not in self._free_queue, (
                    f"{self.name} block {block.block_id} in use but queued as free"
                )
            else:
                assert block.block_id in self._free_queue, (
                    f"{self.name} block {block.block_id} unreferenced but not queued"
                )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"{self.name} block {block.block_id} hash not mapped to it"
                )
        assert in_use + len(self._free_queue) == self.num_blocks, f"{self.name} blocks lost"
        assert len(self._cached) <= self.num_blocks, f"{self.name} hash map over capacity"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, (
                f"{self.name} hash map entry points to block {block_id} holding another hash"
            )
