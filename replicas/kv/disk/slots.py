"""The own slab's slot index, in memory: which block each slot holds, least recently used
first, the free slots, the generation counter, the hit weight each own record carries, the
*batch* blocks (stored from a host block of the batch class, ``replicas.kv.block_pool``),
evicted before any other, least recently used first, and the retention deadlines that keep
some blocks ahead of ordinary ones, by the host tier's two rules
(``replicas.kv.free_block_queue``): *pin*, a retained block is evicted only when every own
block is retained; *decay*, a block last used at ``r`` and retained until ``u`` counts at ``t``
as used at ``r + max(0, u - t)``, so its protection shrinks to nothing by its deadline.

No IO: the store (``replicas.kv.disk.store.DiskStore``) writes what this index decides. The
engine thread alone calls it. Classes and deadlines live here only, so after a restart every
block is ordinary.
"""

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import NamedTuple

from replicas.kv.disk.record import NO_HEAT, Heat, Recovered
from replicas.kv.disk.tenants import SlotTenants
from replicas.kv.hashing import BlockHash
from replicas.kv.keyed_heap import KeyedHeap
from replicas.kv.records import TierUsage
from replicas.kv.tenants import NO_TENANT


class Placement(NamedTuple):
    """Where a newly stored block goes: its slot, the generation its record gets, and the own
    block it replaced (None when the slot was free)."""

    slot: int
    generation: int
    evicted: BlockHash | None


class OwnSlots:
    """The blocks of the own slab by key: LRU among ordinary blocks, retained blocks skipped
    while an ordinary one is left (pin) or while one was used earlier than they count as used
    (``decay``; ``take``). ``max_retained`` bounds the retained blocks; ``clock`` times their
    deadlines and the blocks' last uses."""

    def __init__(
        self,
        num_slots: int,
        max_retained: int,
        clock: Callable[[], float],
        decay: bool = False,
    ) -> None:
        self.num_slots = num_slots
        self.max_retained = max_retained
        self.clock = clock
        self.decay = decay
        self._used: dict[BlockHash, float] = {}  # decay: key -> last use on ``clock``
        self._by_value = KeyedHeap()  # decay: retained keys by last use + deadline
        self.num_evicted = 0  # own blocks overwritten by newer ones
        self._own: OrderedDict[BlockHash, int] = OrderedDict()  # key -> slot, oldest first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._generation = 0
        self._heat: dict[BlockHash, Heat] = {}
        self._retained: dict[BlockHash, float] = {}  # key -> deadline on ``clock``
        self._batch: OrderedDict[BlockHash, None] = OrderedDict()  # batch keys, oldest first
        self._deadlines: list[tuple[float, BlockHash]] = []  # heap; stale entries skipped
        self.tenants = SlotTenants(num_slots)  # each block's tenant, and the tenants' quotas

    def restore(self, found: list[Recovered]) -> None:
        """Take back the blocks the slab held before a restart (oldest generation first): of
        two records of one key, the newer is kept and the older's slot is free."""
        for generation, slot, key, heat in found:
            self._own.pop(key, None)
            self._own[key] = slot
            self._heat[key] = heat
            self._generation = max(self._generation, generation)
        held = set(self._own.values())
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in held]

    # ---- what the index holds ------------------------------------------------------------------
    def __contains__(self, key: BlockHash) -> bool:
        return key in self._own

    def __len__(self) -> int:
        return len(self._own)

    def __iter__(self) -> Iterator[BlockHash]:
        """The own keys, least recently used first."""
        return iter(self._own)

    def slot_of(self, key: BlockHash) -> int | None:
        return self._own.get(key)

    def heat_of(self, key: BlockHash) -> Heat | None:
        """The hit weight an own block's record carries (None for another slab's block)."""
        return self._heat.get(key)

    def ordinary_heats(self) -> Iterator[tuple[BlockHash, Heat]]:
        """(key, heat) per own block not retained, least recently used first."""
        return ((k, self._heat.get(k, NO_HEAT)) for k in self._own if k not in self._retained)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> TierUsage:
        """The own slab: slots, none in use (a read copies out at once), cached, retained."""
        return TierUsage(self.num_slots, 0, len(self._own), len(self._retained))

    # ---- changes -------------------------------------------------------------------------------
    def touch(self, key: BlockHash, batch: bool | None = None) -> None:
        """Make an own block the most recently used; a use that is not ``batch`` makes it
        ordinary (None: a read, which keeps its class)."""
        self._own.move_to_end(key)
        self.tenants.used(key)
        if batch is False:
            self._batch.pop(key, None)
        elif key in self._batch:
            self._batch.move_to_end(key)
        self._use(key)

    def _use(self, key: BlockHash) -> None:
        """Decay: stamp a block used now (a retained one's priority restarts from now)."""
        if self.decay:
            self._used[key] = now = self.clock()
            if key in self._retained:
                self._by_value.add(key, now + self._retained[key])

    def take(
        self, key: BlockHash, heat: Heat, batch: bool = False, tenant: int = NO_TENANT
    ) -> Placement:
        """Give a new key (not held), ``tenant``'s block, a slot: a free one, else the
        evictee's (``_evictee``)."""
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self._evictee()
            slot = self._own.pop(evicted)
            self._drop(evicted)
            self.num_evicted += 1
        self._own[key] = slot
        if batch:
            self._batch[key] = None
        self.tenants.held(key, tenant)
        self._generation += 1
        self._heat[key] = heat
        self._use(key)
        return Placement(slot, self._generation, evicted)

    def _drop(self, key: BlockHash) -> None:
        """Forget what is kept of a block that left the own slab (its slot is handled)."""
        self._retained.pop(key, None)
        self._batch.pop(key, None)
        self._heat.pop(key, None)
        self._used.pop(key, None)
        self._by_value.pop(key)
        self.tenants.dropped(key)

    def _evictee(self) -> BlockHash:
        """The own block a store replaces: the least recently used batch one, else the least
        recently used one of a tenant over its quota (``SlotTenants``), else the least
        recently used ordinary one; retained ones met on the way move to the back. Only when
        every own block is retained, the least recently used of them."""
        if self._retained:
            self.expire()
        batch = next((k for k in self._batch if k not in self._retained), None)
        if batch is not None:
            return batch
        over_quota = self.tenants.evictee(self._retained)
        if over_quota is not None:
            return over_quota
        if self.decay:
            return self._decayed_evictee()
        for _ in range(len(self._own)):
            key = next(iter(self._own))
            if key not in self._retained:
                return key
            self._own.move_to_end(key)
        return next(iter(self._own))

    def _decayed_evictee(self) -> BlockHash:
        """Decay: the least recently used ordinary block, or the retained block that counts as
        used earliest (last use + deadline - now) where that is earlier. Retained blocks keep
        their place in the LRU order, so one whose retention ends is ordinary where its last
        use puts it."""
        front = next((k for k in self._own if k not in self._retained), None)
        first = self._by_value.first()
        if first is None or front is None:
            return front if front is not None else next(iter(self._own))
        counts_as_used = first[0] - self.clock()
        return first[1] if counts_as_used < self._used.get(front, 0.0) else front

    def reweigh(self, key: BlockHash, heat: Heat) -> int | None:
        """Give an own block a new heat; its slot (None, and nothing changed, if not own)."""
        slot = self._own.get(key)
        if slot is not None:
            self._heat[key] = heat
        return slot

    def forget(self, key: BlockHash) -> int | None:
        """Free an own block's slot; the slot (None for a key not held)."""
        slot = self._own.pop(key, None)
        self._drop(key)
        if slot is not None:
            self._free.append(slot)
        return slot

    def clear(self) -> list[BlockHash]:
        """Free every slot; the keys forgotten, least recently used first."""
        keys = list(self._own)
        self._own.clear()
        self._retained.clear()
        self._batch.clear()
        self._heat.clear()
        self._used.clear()
        self._by_value.clear()
        self.tenants.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        return keys

    # ---- retention -----------------------------------------------------------------------------
    def retain(self, key: BlockHash, until: float) -> bool:
        """Keep an own block ahead of ordinary ones until ``until`` (a later deadline extends
        it); False when it is not an own block or ``max_retained`` are retained already."""
        if until <= 0.0 or key not in self._own:
            return False
        if key in self._retained:
            self._retained[key] = max(self._retained[key], until)  # its heap entry follows
            self._value(key)
            return True
        self.expire()
        if len(self._retained) >= self.max_retained:
            return False
        self._retained[key] = until
        self._value(key)
        heapq.heappush(self._deadlines, (until, key))
        if len(self._deadlines) > 2 * len(self._retained) + 16:  # entries of evicted blocks
            self._deadlines = [(until, k) for k, until in self._retained.items()]
            heapq.heapify(self._deadlines)
        return True

    @property
    def num_retained(self) -> int:
        """Own blocks retained (as of the last expiry)."""
        return len(self._retained)

    def expire(self) -> None:
        """Make every own block whose deadline has passed ordinary again (mutates)."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            until, key = heapq.heappop(self._deadlines)
            current = self._retained.get(key)
            if current is not None and current > until:  # extended: its entry moves on
                heapq.heappush(self._deadlines, (current, key))
            elif current is not None:
                del self._retained[key]
                self._by_value.pop(key)

    def _value(self, key: BlockHash) -> None:
        """Decay: a retained block's place among the retained, by last use + deadline."""
        if self.decay:
            self._by_value.add(key, self._used.get(key, 0.0) + self._retained[key])
