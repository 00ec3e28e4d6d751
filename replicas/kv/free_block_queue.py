"""The unreferenced blocks of one ``BlockPool``, in the order allocation takes them.

The pool owns each block's ref count, hash and retention; this queue owns only the order in
which its unreferenced blocks are reused. It reads a block's hash and retention to place it and
changes nothing of a block but the time it was released.

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

**Retained blocks** (``BlockPool.retain``) are ordered by one of two rules, the pool's
``retained_priority`` (``kv_offload_config.retained_priority``):

- *decay* (the default): a retained block's priority decays over its lifetime. Released at
  ``r`` and retained until ``u``, at time ``t`` it counts as if released at
  ``v = r + max(0, u - t)``: just after release it sits behind every ordinary block (``v`` is
  ``u``, later than any release so far), its protection shrinks as ``t`` nears ``u``, and at its
  deadline it is an ordinary block released at ``r``. The retained blocks wait in a heap by
  ``r + u`` (the order of ``v`` among them at any ``t``); allocation takes the heap's first when
  its ``v`` is earlier than the release time of the ordinary queue's front, else that front.
  Its retention ended (``unretain``), a block waits in a second heap by ``r``, and allocation
  takes the earliest of the three. Before its deadline a block is evicted once
  ``r + u - t`` is earlier than the ordinary front's release ``t - L`` (``L``, how long ordinary
  blocks last): it lasts ``(u - r + L) / 2``, at least half its lifetime however heavy the
  traffic, and as long as an ordinary block when that is longer::

    | free | kept | batch | over-quota | cached: ordinary, retained, expired, by v, earliest |

- *pin*: released, a retained block waits in a third LRU queue that allocation takes from only
  when the ordinary queue is empty; when its retention ends, it re-enters the ordinary queue at
  the back, as if just released::

    ordinary queue:  | free ... | cached, least recently released ... just released |  <- first
    retained queue:  | retained, least recently released ... just released |         <- then

A block whose retention ended waits in the decay rule's second heap, and in a heap of its
tenant's by release time: an over-quota tenant's next block is the earlier-released of its
queue's front and its expired heap's first. The queue stamps each block it queues with the time
(``Block.released``, on ``clock``).
"""

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from replicas.kv.keyed_heap import KeyedHeap
from replicas.kv.tenants import NO_TENANT, TenantQuotas

if TYPE_CHECKING:
    from replicas.kv.block_pool import Block

DECAY = "decay"
PIN = "pin"
RETAINED_PRIORITIES = (DECAY, PIN)
"""How retained blocks are ordered in eviction (module docstring), by their config names."""


class FreeBlockQueue:
    """The unreferenced blocks of one pool in LRU queues (ordinary, kept, batch) and, for the
    retained ones, an LRU queue (``decay`` False: the pin rule) or two heaps (the decay rule).
    ``blocks`` is the pool's block list, read to place each block; ``clock`` (seconds) stamps
    release times and ages retained blocks. Not thread-safe: the pool's engine loop alone
    mutates it."""

    def __init__(
        self,
        blocks: "list[Block]",
        name: str,
        quotas: TenantQuotas | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        decay: bool = False,
    ) -> None:
        self.name = name
        self.decay = decay
        self._blocks = blocks
        self._clock = clock
        self._quotas = quotas if quotas is not None else TenantQuotas()
        self._by_tenant: dict[int, OrderedDict[int, None]] = {}  # cached ones in _ordinary
        self._ordinary: OrderedDict[int, None] = OrderedDict((b.block_id, None) for b in blocks)
        self._kept: OrderedDict[int, None] = OrderedDict()
        self._batch: OrderedDict[int, None] = OrderedDict()
        # pin: LRU; decay: by release + deadline
        self._retained: OrderedDict[int, None] | KeyedHeap = KeyedHeap() if decay else OrderedDict()
        self._expired = KeyedHeap()  # decay: blocks whose retention ended, by release time
        self._expired_by_tenant: dict[int, KeyedHeap] = {}  # those of _expired, per tenant

    # ---- queries (no mutation) ---------------------------------------------------------------
    def __len__(self) -> int:
        queues = (self._ordinary, self._kept, self._batch, self._retained, self._expired)
        return sum(len(q) for q in queues)

    @property
    def num_empty(self) -> int:
        """Queued blocks holding no hash: taking up to this many evicts no cached block."""
        empty = sum(1 for b in self._ordinary if self._blocks[b].block_hash is None)
        return empty + len(self._kept)

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def order(self) -> list[int]:
        """Block ids in the order ``pop`` would take them (at the clock's time now)."""
        ordinary = list(self._ordinary)
        num_empty = next(
            (i for i, b in enumerate(ordinary) if self._blocks[b].block_hash is not None),
            len(ordinary),
        )
        over = [b for t in self._quotas.over for b in self._tenant_order(t)]
        taken = set(over)
        cached = [b for b in ordinary[num_empty:] if b not in taken]
        front = [*ordinary[:num_empty], *self._kept, *self._batch, *over]
        if not self.decay:
            return [*front, *cached, *self._retained]
        now = self._clock()
        merged = heapq.merge(  # as ``_earliest`` compares the three fronts
            ((self._blocks[b].released, 0, b) for b in cached),
            ((key, 1, b) for key, b in self._expired.items() if b not in taken),
            ((key - now, 2, b) for key, b in self._retained.items()),
        )
        return [*front, *(b for _, _, b in merged)]

    def peek(self) -> int | None:
        """The block id ``pop`` would take (None when the queue is empty)."""
        queue = self._next_queue()
        if isinstance(queue, KeyedHeap):
            first = queue.first()
            return first[1] if first else None
        return next(iter(queue)) if queue else None

    def _next_queue(self) -> OrderedDict | KeyedHeap:
        """The queue ``pop`` takes from: empty blocks (at the front of the ordinary queue), then
        kept ones, then batch ones, then over-quota tenants', then cached ones and retained ones
        (pin: every cached one first; decay: ``_earliest``)."""
        front = next(iter(self._ordinary), None)
        if front is not None and self._blocks[front].block_hash is None:
            return self._ordinary
        if self._kept or self._batch:
            return self._kept or self._batch
        for tenant in self._quotas.over:
            if queue := self._tenant_next(tenant):
                return queue
        if not (self.decay and (self._retained or self._expired)):
            return self._ordinary or self._retained
        return self._earliest()

    def _tenant_next(self, tenant: int) -> OrderedDict | KeyedHeap | None:
        """The queue of ``tenant``'s whose first block was released earlier: its ordinary
        queue or its expired heap (None when it has neither)."""
        queue, expired = self._by_tenant.get(tenant), self._expired_by_tenant.get(tenant)
        if not expired:
            return queue or None
        if not queue:
            return expired
        released = self._blocks[next(iter(queue))].released
        return expired if expired.first()[0] < released else queue

    def _tenant_order(self, tenant: int) -> list[int]:
        """``tenant``'s queued ordinary and expired blocks in the order ``_tenant_next`` takes
        them."""
        ordinary = [(self._blocks[b].released, 1, b) for b in self._by_tenant.get(tenant, ())]
        expired = self._expired_by_tenant.get(tenant)
        if not expired:
            return [b for _, _, b in ordinary]
        merged = heapq.merge([(k, 0, b) for k, b in expired.items()], ordinary)
        return [b for _, _, b in merged]

    def _earliest(self) -> OrderedDict | KeyedHeap:
        """The decay rule: of the ordinary queue, the expired heap and the retained heap, the
        one whose first block counts as released earliest (ties in that order)."""
        candidates: list[tuple[float, int, OrderedDict | KeyedHeap]] = []
        if self._ordinary:
            front = self._blocks[next(iter(self._ordinary))]
            candidates.append((front.released, 0, self._ordinary))
        if (first := self._expired.first()) is not None:
            candidates.append((first[0], 1, self._expired))
        if (first := self._retained.first()) is not None:
            candidates.append((first[0] - self._clock(), 2, self._retained))
        if not candidates:
            return self._ordinary
        return min(candidates, key=lambda c: c[:2])[2]

    def _queue_of(self, block: "Block") -> OrderedDict | KeyedHeap:
        if block.retained_until:
            return self._retained
        if block.block_id in self._kept:
            return self._kept
        if block.block_id in self._expired:
            return self._expired
        return self._batch if block.batch and block.block_hash is not None else self._ordinary

    # ---- mutation ----------------------------------------------------------------------------
    def pop(self) -> int:
        """Take the next block id (the queue must not be empty)."""
        queue = self._next_queue()
        if isinstance(queue, KeyedHeap):
            block_id = queue.take()
            if queue is not self._retained:  # the expired heap or a tenant's: leave the other
                self._unexpire(self._blocks[block_id])
            return block_id
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
        elif queue is self._expired:
            self._unexpire(block)

    def _enqueue(self, block: "Block") -> None:
        """A cached or empty block to the back of its queue (and its tenant's); a retained one,
        under the decay rule, into the retained heap."""
        if block.retained_until and self.decay:
            self._retained.add(block.block_id, block.released + block.retained_until)
            return
        queue = self._queue_of(block)
        queue[block.block_id] = None
        if queue is self._ordinary and block.block_hash is not None and block.tenant:
            self._by_tenant.setdefault(block.tenant, OrderedDict())[block.block_id] = None

    def _untenant(self, block: "Block") -> None:
        if block.tenant != NO_TENANT and block.tenant in self._by_tenant:
            self._by_tenant[block.tenant].pop(block.block_id, None)

    def _unexpire(self, block: "Block") -> None:
        """An expired block leaves both its heaps (whichever it was taken from)."""
        self._expired.pop(block.block_id)
        if block.tenant in self._expired_by_tenant:
            self._expired_by_tenant[block.tenant].pop(block.block_id)

    def push(self, block: "Block", keep: bool, keep_at_back: bool) -> None:
        """Queue a block whose last reference dropped, stamped released now: cached ones at the
        back, empty ones at the front, but an empty one to ``keep`` at the back of the kept
        queue (with ``keep_at_back``, at the back of the ordinary queue)."""
        block.released = self._clock()
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

    def retain(self, block_id: int, until: float) -> None:
        """A queued cached block is retained until ``until``, newly or for longer, by a request
        that uses its contents now (through another tier's copy): pin, it moves to the back of
        the retained queue (a longer retention leaves it in place); decay, it is stamped
        released now and waits in the retained heap by now + ``until``. Call it before the
        pool sets ``retained_until``."""
        block = self._blocks[block_id]
        if not block.retained_until:
            self.remove(block)
        if self.decay:
            block.released = self._clock()
            self._retained.add(block_id, block.released + until)
        elif not block.retained_until:
            block.released = self._clock()
            self._retained[block_id] = None

    def unretain(self, block_id: int) -> None:
        """A queued block whose retention ended (``retained_until`` cleared): pin, to the back
        of its queue, as if just released; decay, a cached block not batch waits in the expired
        heap by its release time, an ordinary block released then."""
        self._retained.pop(block_id)
        block = self._blocks[block_id]
        if self.decay and block.block_hash is not None and not block.batch:
            self._expired.add(block_id, block.released)
            if block.tenant != NO_TENANT:
                tenant = self._expired_by_tenant.setdefault(block.tenant, KeyedHeap())
                tenant.add(block_id, block.released)
            return
        if not self.decay:
            block.released = self._clock()
        self._enqueue(block)

    def release_cached(self) -> list[int]:
        """Move every queued cached block (retained ones first, then expired ones, each queue
        front to back) to the front of the ordinary queue, as the pool forgets their hashes;
        returns their ids in that order."""
        queues = (*self._retained, *self._expired, *self._batch, *self._ordinary)
        cached = [b for b in queues if self._blocks[b].block_hash is not None]
        for block_id in cached:
            self._ordinary[block_id] = None
            self._ordinary.move_to_end(block_id, last=False)
        self._retained.clear()
        self._expired.clear()
        self._expired_by_tenant.clear()
        self._batch.clear()
        self._by_tenant.clear()
        return cached

    # ---- accounting --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless exactly the unreferenced blocks are queued, each in one
        queue, its own (retained ones in the retained queue at their key, no cached block kept,
        only cached ordinary blocks expired)."""
        queues = (self._ordinary, self._kept, self._batch, self._expired, self._retained)
        num_in_tenants = 0
        for block in self._blocks:
            block_id = block.block_id
            where = [block_id in q for q in queues]
            assert sum(where) <= 1, f"{self.name} block {block_id} in more than one queue"
            self._check_block(block, where[-1], where[-2])
            in_tenant = block_id in self._by_tenant.get(block.tenant, ())
            assert in_tenant == (
                where[0] and block.block_hash is not None and bool(block.tenant)
            ), f"{self.name} block {block_id} not in its tenant's queue as it is in the ordinary"
            num_in_tenants += in_tenant
            if block.ref_count > 0:
                assert not any(where), f"{self.name} block {block_id} in use but queued as free"
            else:
                assert (any(where[:-1]), where[-1]) == (
                    not block.retained_until,
                    bool(block.retained_until),
                ), f"{self.name} block {block_id} unreferenced but not in its queue"
        assert num_in_tenants == sum(len(q) for q in self._by_tenant.values()), (
            f"{self.name} tenant queues hold blocks no longer queued"
        )
        expired = {b for heap in self._expired_by_tenant.values() for b in heap}
        assert expired == {b for b in self._expired if self._blocks[b].tenant != NO_TENANT}, (
            f"{self.name} tenants' expired heaps are not the expired heap's tenant blocks"
        )

    def _check_block(self, block: "Block", retained: bool, expired: bool) -> None:
        """One block's place in the batch, kept, expired and retained queues."""
        block_id = block.block_id
        assert block_id not in self._batch or (block.batch and block.block_hash), (
            f"{self.name} block {block_id} queued as batch but not a cached batch block"
        )
        assert not (block_id in self._kept and block.block_hash is not None), (
            f"{self.name} block {block_id} kept while cached"
        )
        assert not expired or (
            self.decay
            and block.block_hash is not None
            and not block.batch
            and self._expired.key(block_id) == block.released
        ), f"{self.name} block {block_id} expired but not a cached ordinary one at its release"
        if retained and self.decay:
            key = block.released + block.retained_until
            assert self._retained.key(block_id) == key, (
                f"{self.name} block {block_id} in the retained heap at another key"
            )
