"""Handing a replica's cache over when the deployment is resized: through the node's disk tier
(the *hand-over tier*: a cache type's first backing tier shared by the node's replicas whose
store is a ``replicas.kv.tiers.HandoverStore``; the disk tier is the built-in one), and through
the peer tier across nodes (``replicas.kv.tiers.peer``).

Scale-in: a draining replica writes the NPU and host blocks the disk lacks into its own disk
slab, hottest first (``WriteOut``), and a survivor pulls its hottest blocks through the peer
tier into its host tier (``WarmStart`` of a ``WarmSource``, up to a share of that tier).
Scale-out: a new replica reads the node's disk blocks (every slab) into empty host blocks,
hottest first, before it serves (``WarmStart``), then its peers' hottest blocks it still lacks
(a ``WarmSource``). "Hottest" is the hit weight (``replicas.kv.hotness``), which each disk
record keeps and each replica reports (``Engine.hot_blocks``).

All are planned in rounds that the engine runs between steps (``replicas.engine.handover``):
a round plans a batch of copies into the manager's transfer plan,
the engine runs the plan, waits for it and checks its time budget before the next round. An NPU
block reaches the disk through a host block, as every disk store does::

    write-out round k   staged in round k-1: host -> disk
                        next batch: a host block -> disk; an NPU-only block -> a new host block
    warm-start round    next batch: disk (or a peer) -> a free host block

A write-out chooses its blocks once, at the start: per cache type, the blocks its disk does not
hold, as many of the hottest as the own slab takes without replacing a hotter block
(``HandoverStore.room_for``). The colder own blocks they replace are forgotten round by round, only
as their slots are needed, so that a write-out cut short by its time budget loses none for
nothing. The chosen host blocks stay locked until their round, so that staging NPU blocks into
host never evicts one still to be written. Blocks the own slab already holds get their current
weight recorded (``HandoverStore.set_weight``).
"""

from collections import deque
from typing import NamedTuple

from replicas.kv.cache_type import CacheType
from replicas.kv.hashing import BlockHash
from replicas.kv.hotness import HitWeights
from replicas.kv.onboarding import Onboarding
from replicas.kv.type_manager import CacheTypeManager

HANDOVER_BATCH_BLOCKS = 64
"""Blocks one round of a write-out or a warm start copies: the time budget is checked between
rounds."""


class _Chosen(NamedTuple):
    weight: float
    manager: CacheTypeManager
    block_hash: BlockHash

    @property
    def cache_type(self) -> CacheType:
        return self.manager.cache_type


def hot_blocks(primary: CacheType, weights: HitWeights) -> dict[BlockHash, float]:
    """Every block the primary cache type holds in a pooled tier (NPU, host): the hashes a
    router indexes, with their hit weights now (0.0: no recent hit)."""
    return weights.weights(h for pool in primary.pools for h in pool.cached_hashes())


class WriteOut:
    """One write-out of a replica's NPU and host blocks to its disk slab (see the module
    docstring). Not thread-safe: the engine thread plans it; ``end`` releases what it holds."""

    def __init__(self, managers: list[CacheTypeManager], weights: HitWeights) -> None:
        """``managers``: one per cache type; nothing is written without a hand-over tier."""
        chosen: list[_Chosen] = []
        self._replaced: dict[str, deque[BlockHash]] = {}  # own disk blocks to forget, coldest first
        self._num_claimed: dict[str, int] = {}  # free slots this round's stores take
        for manager in managers if managers[0].cache_type.handover is not None else ():
            blocks, replaced = _choose(manager, weights)
            chosen.extend(blocks)
            self._replaced[manager.name] = deque(replaced)
        chosen.sort(key=lambda c: c.weight, reverse=True)  # stable: cache types in order
        self._pending = deque(chosen)
        self._staged: list[tuple[CacheTypeManager, int, BlockHash]] = []  # host blocks, locked
        self._locked: dict[tuple[str, BlockHash], int] = {}  # chosen host blocks -> host id
        self._cache_types = [m.cache_type for m in managers]
        for c in chosen:
            host_id = c.cache_type.host.lookup(c.block_hash)
            if host_id is not None:
                c.cache_type.host.touch([host_id])
                self._locked[(c.cache_type.name, c.block_hash)] = host_id

    @property
    def is_done(self) -> bool:
        return not self._pending and not self._staged

    def plan_round(self, max_blocks: int) -> int:
        """Plan the next round (mutates); returns the disk stores planned. A round that can
        plan nothing (no host block to stage through) ends the write-out."""
        self._num_claimed = dict.fromkeys(self._replaced, 0)  # the last round's stores are in
        num_stores = 0
        for manager, host_id, block_hash in self._staged:
            self._store(manager, host_id, block_hash)
            num_stores += 1
        self._staged = []
        deferred: deque[_Chosen] = deque()
        num_planned = 0
        while self._pending and num_planned < max_blocks:
            c = self._pending.popleft()
            host_id = self._locked.pop((c.cache_type.name, c.block_hash), None)
            if host_id is not None:
                self._store(c.manager, host_id, c.block_hash)
                num_stores += 1
            elif not self._stage(c):
                deferred.append(c)  # after a host block of the batch is written, maybe
                continue
            num_planned += 1
        self._pending.extendleft(reversed(deferred))
        if not num_planned and not num_stores:
            self.end()
        return num_stores

    def _store(self, manager: CacheTypeManager, host_id: int, block_hash: BlockHash) -> None:
        """Plan a held host block's copy to disk into a free own slot, forgetting the next
        replaced block when none is left; then release the hold (the copy holds its own)."""
        cache_type = manager.cache_type
        name = cache_type.name
        self._num_claimed[name] += 1
        replaced = self._replaced[name]
        handover = cache_type.handover
        while handover.store.num_free_slots < self._num_claimed[name] and replaced:
            handover.store.forget(replaced.popleft())
        manager.writes_to(handover.tier).store(host_id, block_hash)
        cache_type.host.free([host_id])

    def _stage(self, c: _Chosen) -> bool:
        """Plan an NPU-only block's copy into a new host block, held for the next round."""
        npu_id = c.cache_type.npu.lookup(c.block_hash)
        if npu_id is None:  # evicted since it was chosen: nothing to write
            return True
        if not c.manager.store(npu_id, c.block_hash):
            return False
        host_id = c.cache_type.host.lookup(c.block_hash)
        c.cache_type.host.touch([host_id])  # kept until its disk store is planned
        self._staged.append((c.manager, host_id, c.block_hash))
        return True

    def end(self) -> None:
        """Stop: release every host block held for blocks not written (they stay cached)."""
        by_name = {c.name: c for c in self._cache_types}
        for (name, _), host_id in self._locked.items():
            by_name[name].host.free([host_id])
        for manager, host_id, _ in self._staged:
            manager.cache_type.host.free([host_id])
        self._locked, self._staged, self._pending = {}, [], deque()


def _choose(
    manager: CacheTypeManager, weights: HitWeights
) -> tuple[list[_Chosen], list[BlockHash]]:
    """A cache type's pooled blocks its disk lacks, hottest first, as many as its slab takes,
    and the own disk blocks they replace; the blocks the disk holds get their current weight."""
    cache_type = manager.cache_type
    disk = cache_type.handover.store
    held = weights.weights(h for pool in cache_type.pools for h in pool.cached_hashes())
    candidates = []
    for block_hash, weight in held.items():
        if not disk.contains(block_hash):
            candidates.append(_Chosen(weight, manager, block_hash))
        elif weight > 0.0:
            disk.set_weight(block_hash, weight)
    candidates.sort(key=lambda c: c.weight, reverse=True)
    num_fit, replaced = disk.room_for([c.weight for c in candidates])
    return candidates[:num_fit], replaced


class WarmSource(NamedTuple):
    """Blocks a warm start reads from a tier other than the hand-over tier (another replica's,
    through the peer tier): the tier, the hashes hottest first, and the share of the host tier
    they may take (empty blocks first, then the least recently used cached ones; at least the
    empty blocks)."""

    tier: str
    hashes: list[BlockHash]
    max_share: float = 0.0


class WarmStart:
    """Reads of the node's disk blocks into the host blocks empty when it starts, hottest first
    (see the module docstring), or of a ``WarmSource``'s blocks; nothing else may allocate host
    blocks meanwhile. Not thread-safe: the engine thread plans it."""

    def __init__(
        self,
        managers: list[CacheTypeManager],
        onboarding: Onboarding,
        source: WarmSource | None = None,
    ) -> None:
        self._onboarding = onboarding
        first = managers[0].cache_type
        if source is None:
            self._tier = first.handover.tier if first.handover is not None else None
        else:
            self._tier = source.tier if any(b.tier == source.tier for b in first.backing) else None
        is_on = self._tier is not None and all(m.cache_type.host is not None for m in managers)
        self._managers = managers if is_on else []
        self._cache_types = [m.cache_type for m in self._managers]
        share = source.max_share if source is not None else 0.0
        self._rooms = [
            min(c.host.num_free, max(c.host.num_empty, int(share * c.host.num_blocks)))
            for c in self._cache_types
        ]
        self._queues = [
            deque(
                [
                    h
                    for h in (c.handover.store.hottest() if source is None else source.hashes)
                    if not c.in_pools(h)
                ][:room]
            )
            for c, room in zip(self._cache_types, self._rooms)
        ]

    @property
    def is_done(self) -> bool:
        """No block left to read, or no empty host block left for it."""
        return not any(q and room for q, room in zip(self._queues, self._rooms))

    def plan_round(self, max_blocks: int) -> int:
        """Plan up to ``max_blocks`` reads per cache type into host blocks (mutates); returns
        how many."""
        num_planned = 0
        for i, (manager, queue) in enumerate(zip(self._managers, self._queues)):
            num_reads = min(max_blocks, self._rooms[i], len(queue))
            for _ in range(num_reads):
                self._onboarding.read_for_warm_start(manager, self._tier, queue.popleft())
            self._rooms[i] -= num_reads
            num_planned += num_reads
        return num_planned
