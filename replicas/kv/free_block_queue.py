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

**Tenants over their quota** (``replicas.kv.tenants``): each tenant's queued ordinary cached
blocks are also kept in a queue of the tenant's, in the same order; while a tenant holds more
blocks than its quota, its queue is taken from after the batch queue and before the rest of the
ordinary queue::

    | free | kept | batch | over-quota tenants' cached, LRU | cached (ordinary) | retained |

**Retained blocks** (``BlockPool.retain``) wait in a third queue that allocation takes from only
when the ordinary queue is empty; when its retention ends, a block re-enters the ordinary queue
at the back, as if just released::

    ordinary queue:  | free ... | cached, least recently released ... just released |  <- first
    retained queue:  | retained, least recently released ... just released |         <- then
"""

from collections import OrderedDict
from typing import TYPE_CHECKING

from replicas.kv.tenants import NO_TENANT, TenantQuotas

if TYPE_CHECKING:
    from replicas.kv.block_pool import Block


class FreeBlockQueue:
    """The unreferenced blocks of one pool in four LRU queues (ordinary, kept, batch, retained).
    ``blocks`` is the pool's block list, read to place each block. Not thread-safe: the pool's
    engine loop alone mutates it."""

    def __init__(
        self, blocks: "list[Block]", name: str, quotas: TenantQuotas | None = None
    ) -> None:
        self.name = name
        self._blocks = blocks
        self._quotas = quotas if quotas is not None else TenantQuotas()
        self._by_tenant: dict[int, OrderedDict[int, None]] = {}  # cached ones in _ordinary
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
        over = [b for t in self._quotas.over for b in self._by_tenant.get(t, ())]
        taken = set(over)
        cached = [b for b in ordinary[num_empty:] if b not in taken]
        return [*ordinary[:num_empty], *self._kept, *self._batch, *over, *cached, *self._retained]

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
        if self._kept or self._batch:
            return self._kept or self._batch
        for tenant in self._quotas.over:
            if self._by_tenant.get(tenant):
                return self._by_tenant[tenant]
        return self._ordinary or self._retained

    def _queue_of(self, block: "Block") -> OrderedDict:
        if block.retained_until:
            return self._retained
        if block.block_id in self._kept:
            return self._kept
        return self._batch if block.batch and block.block_hash is not None else self._ordinary

    # ---- mutation ----------------------------------------------------------------------------
    def pop(self) -> int:
        """Take the next block id (the queue must not be empty)."""
        queue = self._next_queue()
        block_id, _ = queue.popitem(last=False)
        if queue is self._ordinary:
            self._untenant(self._blocks[block_id])
        elif queue is not self._kept and queue is not self._batch and queue is not self._retained:
            del self._ordinary[block_id]  # from an over-quota tenant's queue
        return block_id

    def remove(self, block: "Block") -> None:
        """Take a queued block out of its queue (it is referenced again)."""
        queue = self._queue_of(block)
        queue.pop(block.block_id)
        if queue is self._ordinary:
            self._untenant(block)

    def _enqueue(self, block: "Block") -> None:
        """A cached or empty block to the back of its queue (and its tenant's)."""
        queue = self._queue_of(block)
        queue[block.block_id] = None
        if queue is self._ordinary and block.block_hash is not None and block.tenant:
            self._by_tenant.setdefault(block.tenant, OrderedDict())[block.block_id] = None

    def _untenant(self, block: "Block") -> None:
        if block.tenant != NO_TENANT and block.tenant in self._by_tenant:
            self._by_tenant[block.tenant].pop(block.block_id, None)

    def push(self, block: "Block", keep: bool, keep_at_back: bool) -> None:
        """Queue a block whose last reference dropped: cached ones at the back, empty ones at the
        front, but an empty one to ``keep`` at the back of the kept queue (with
        ``keep_at_back``, at the back of the ordinary queue)."""
        if block.block_hash is None and keep:
            (self._ordinary if keep_at_back else self._kept)[block.block_id] = None
            return
        self._enqueue(block)
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
        if block_id in self._batch:
            del self._batch[block_id]
        else:
            del self._ordinary[block_id]
            self._untenant(self._blocks[block_id])
        self._retained[block_id] = None

    def unretain(self, block_id: int) -> None:
        """Move a queued block whose retention ended to the back of its queue."""
        del self._retained[block_id]
        self._enqueue(self._blocks[block_id])

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
        self._by_tenant.clear()
        return cached

    # ---- accounting --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless exactly the unreferenced blocks are queued, each in its
        queue (retained ones in the retained queue, no cached block kept)."""
        num_in_tenants = 0
        for block in self._blocks:
            block_id = block.block_id
            queued = (
                block_id in self._ordinary or block_id in self._kept or block_id in self._batch,
                block_id in self._retained,
            )
            assert block_id not in self._batch or (block.batch and block.block_hash), (
                f"{self.name} block {block_id} queued as batch but not a cached batch block"
            )
            in_tenant = block_id in self._by_tenant.get(block.tenant, ())
            assert in_tenant == (
                block_id in self._ordinary and block.block_hash is not None and bool(block.tenant)
            ), f"{self.name} block {block_id} not in its tenant's queue as it is in the ordinary"
            num_in_tenants += in_tenant
            assert not (block_id in self._kept and block.block_hash is not None), (
                f"{self.name} block {block_id} kept while cached"
            )
            if block.ref_count > 0:
                assert not any(queued), f"{self.name} block {block_id} in use but queued as free"
            else:
                assert queued == (not block.retained_until, bool(block.retained_until)), (
                    f"{self.name} block {block_id} unreferenced but not in its queue"
                )
        assert num_in_tenants == sum(len(q) for q in self._by_tenant.values()), (
            f"{self.name} tenant queues hold blocks no longer queued"
        )
