"""The unreferenced blocks of one ``BlockPool``, in the order allocation takes them.

The pool owns each block's ref count, hash and retention; this queue owns only the order in
which its unreferenced blocks are reused. It reads a block's hash and retention to place it and
never changes a block.

Free and cached blocks wait in one LRU queue, the *ordinary* queue. Allocation takes blocks from
its front; a cached block taken there is evicted (its hash leaves the pool's map). Empty blocks
are queued at the front so they are used before any cached block is evicted; released cached
blocks go to the back::

    front (evicted first)                                            back (evicted last)
    | free ... free | cached, least recently released ... cached, just released |

**Kept blocks.** An empty block whose contents may still be read (``BlockPool.free(keep=...)``)
waits in a queue of its own, which allocation takes from after the empty blocks and before
evicting any cached block. Released ``keep_at_back``, it goes to the back of the ordinary queue
instead, and ages there as a cached block does::

    | free ... free | kept, least recently released ... | cached (and served kept) ... |

**Batch blocks** (``BlockPool.mark``): cached blocks last used by a batch request and by no
interactive one within its lifetime wait in a queue of their own, which allocation takes from
after the kept blocks and before any ordinary cached block, so a batch sweep recycles its own
blocks before it evicts an interactive session's::

    | free ... | kept ... | batch, least recently released ... | cached (ordinary) ... |

**Retained blocks** (``BlockPool.retain``) wait in a third queue that allocation takes from only
when the ordinary queue is empty; when its retention ends, a block re-enters the ordinary queue
at the back, as if just released::

    ordinary queue:  | free ... | cached, least recently released ... just released |  <- first
    retained queue:  | retained, least recently released ... just released |         <- then
"""

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replicas.kv.block_pool import Block


class FreeBlockQueue:
    """The unreferenced blocks of one pool in four LRU queues (ordinary, kept, batch, retained).
    ``blocks`` is the pool's block list, read to place each block. Not thread-safe: the pool's
    engine loop alone mutates it."""

    def __init__(self, blocks: "list[Block]", name: str) -> None:
        self.name = name
        self._blocks = blocks
        self._ordinary: OrderedDict[int, None] = OrderedDict((b.block_id, None) for b in blocks)
        self._kept: OrderedDict[int, None] = OrderedDict()
        self._batch: OrderedDict[int, None] = OrderedDict()
        self._retained: OrderedDict[int, None] = OrderedDict()

    # ---- queries (no mutation) ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ordinary) + len(self._kept) + len(self._batch) + len(self._retained)

    @property
    def num_empty(self) -> int:
        """Queued blocks holding no hash: taking up to this many evicts no cached block."""
        empty = sum(1 for b in self._ordinary if self._blocks[b].block_hash is None)
        return empty + len(self._kept)

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def order(self) -> list[int]:
        """Block ids in the order ``pop`` would take them."""
        ordinary = list(self._ordinary)
        num_empty = next(
            (i for i, b in enumerate(ordinary) if self._blocks[b].block_hash is not None),
            len(ordinary),
        )
        cached = ordinary[num_empty:]
        return [*ordinary[:num_empty], *self._kept, *self._batch, *cached, *self._retained]

    def peek(self) -> int | None:
        """The block id ``pop`` would take (None when the queue is empty)."""
        queue = self._next_queue()
        return next(iter(queue)) if queue else None

    def _next_queue(self) -> OrderedDict:
        """The queue ``pop`` takes from: empty blocks (at the front of the ordinary queue), then
        kept ones, then batch ones, then cached ones, retained ones last."""
        front = next(iter(self._ordinary), None)
        if front is not None and self._blocks[front].block_hash is None:
            return self._ordinary
        return self._kept or self._batch or self._ordinary or self._retained

    def _queue_of(self, block: "Block") -> OrderedDict:
        if block.retained_until:
            return self._retained
        if block.block_id in self._kept:
            return self._kept
        return self._batch if block.batch and block.block_hash is not None else self._ordinary

    # ---- mutation ----------------------------------------------------------------------------
    def pop(self) -> int:
        """Take the next block id (the queue must not be empty)."""
        block_id, _ = self._next_queue().popitem(last=False)
        return block_id

    def remove(self, block: "Block") -> None:
        """Take a queued block out of its queue (it is referenced again)."""
        self._queue_of(block).pop(block.block_id)

    def push(self, block: "Block", keep: bool, keep_at_back: bool) -> None:
        """Queue a block whose last reference dropped: cached ones at the back, empty ones at the
        front, but an empty one to ``keep`` at the back of the kept queue (with
        ``keep_at_back``, at the back of the ordinary queue)."""
        if block.block_hash is None and keep:
            (self._ordinary if keep_at_back else self._kept)[block.block_id] = None
            return
        self._queue_of(block)[block.block_id] = None
        if block.block_hash is None:
            self._ordinary.move_to_end(block.block_id, last=False)

    def discard_contents(self, block_id: int) -> None:
        """A queued empty block whose contents are no longer wanted goes to the front of the
        ordinary queue (from the kept queue too)."""
        if block_id in self._kept:
            del self._kept[block_id]
            self._ordinary[block_id] = None
        if block_id in self._ordinary:
            self._ordinary.move_to_end(block_id, last=False)

    def retain(self, block_id: int) -> None:
        """Move a queued block that has just been retained to the back of the retained queue."""
        (self._batch if block_id in self._batch else self._ordinary).pop(block_id)
        self._retained[block_id] = None

    def unretain(self, block_id: int) -> None:
        """Move a queued block whose retention ended to the back of its queue."""
        del self._retained[block_id]
        self._queue_of(self._blocks[block_id])[block_id] = None

    def release_cached(self) -> list[int]:
        """Move every queued cached block (retained ones first, each queue front to back) to
        the front of the ordinary queue, as the pool forgets their hashes; returns their ids in
        that order."""
        queues = (*self._retained, *self._batch, *self._ordinary)
        cached = [b for b in queues if self._blocks[b].block_hash is not None]
        for block_id in cached:
            self._ordinary[block_id] = None
            self._ordinary.move_to_end(block_id, last=False)
        self._retained.clear()
        self._batch.clear()
        return cached

    # ---- accounting --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless exactly the unreferenced blocks are queued, each in its
        queue (retained ones in the retained queue, no cached block kept)."""
        for block in self._blocks:
            block_id = block.block_id
            queued = (
                block_id in self._ordinary or block_id in self._kept or block_id in self._batch,
                block_id in self._retained,
            )
            assert block_id not in self._batch or (block.batch and block.block_hash), (
                f"{self.name} block {block_id} queued as batch but not a cached batch block"
            )
            assert not (block_id in self._kept and block.block_hash is not None), (
                f"{self.name} block {block_id} kept while cached"
            )
            if block.ref_count > 0:
                assert not any(queued), f"{self.name} block {block_id} in use but queued as free"
            else:
                assert queued == (not block.retained_until, bool(block.retained_until)), (
                    f"{self.name} block {block_id} unreferenced but not in its queue"
                )
