"""The simulator's disk tier: ``replicas.kv.disk.DiskStore`` without files.

One ``NodeDisk`` stands for the local disk of the node every simulated replica runs on; each
replica writes through its own ``DiskView`` into its own LRU share of slots (a slab), and reads
any replica's blocks, as real replicas sharing one ``disk_path`` do. Reads never fail; their time
is the hardware profile's disk latency plus bytes over its disk bandwidth
(``CostModel.disk_load_s``), after which the simulated transfer reports them landed.

Each block keeps the hit weight it was stored with and the simulated time of that weight, so
that ``hottest`` ranks the node's blocks as ``DiskStore.hottest`` does (a replica warming from
the disk reads the hottest first). The weights of ordinary stores are the simulated managers'
(undecayed hit counts: their clock is stopped); a drain's write-out passes the simulator's.

With ``announces``, each replica announces its own slab's blocks through its KV events, as a
real ``DiskStore`` does, and the router credits a node's disk blocks to every replica on the
node (``router.backing_index``); without it the simulated router credits NPU and host blocks only.
"""

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from replicas.kv.hashing import BlockHash
from replicas.kv.hotness import decayed
from replicas.kv.records import TierUsage


class SimDiskStats(NamedTuple):
    num_slots: int
    num_cached: int
    evictions: int


class NodeDisk:
    """Every replica's slab of one node's disk tier, for one cache type."""

    def __init__(
        self,
        num_writers: int,
        slots_per_writer: int,
        clock: Callable[[], float] = lambda: 0.0,
        announces: bool = False,
    ) -> None:
        """``clock``: simulated seconds, for the blocks' weights; ``announces``: see the module
        docstring."""
        self.slabs: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_writers)]
        self.slots_per_writer = slots_per_writer
        self.holders: dict[BlockHash, int] = {}  # how many slabs hold the block
        self.heat: dict[BlockHash, tuple[float, float]] = {}  # weight, when it was recorded
        self.clock = clock
        self.announces = announces

    def add_writer(self) -> int:
        """One more replica's empty slab (a scale-out); its writer index."""
        self.slabs.append(OrderedDict())
        return len(self.slabs) - 1

    def view(self, writer: int, read_s_per_block: float) -> "DiskView":
        return DiskView(self, writer, read_s_per_block)

    def hottest(self) -> list[BlockHash]:
        """Every block some slab holds, hottest first: by weight decayed to now, then the most
        recently weighed first."""
        now = self.clock()

        def rank(block_hash: BlockHash) -> tuple[float, float]:
            weight, at = self.heat.get(block_hash, (0.0, 0.0))
            return decayed(weight, now - at), at

        return sorted(self.holders, key=rank, reverse=True)

    def _add(self, block_hash: BlockHash, weight: float) -> None:
        self.holders[block_hash] = self.holders.get(block_hash, 0) + 1
        self.heat[block_hash] = (weight, self.clock())

    def _drop(self, block_hash: BlockHash) -> None:
        count = self.holders[block_hash] - 1
        if count:
            self.holders[block_hash] = count
        else:
            del self.holders[block_hash]
            del self.heat[block_hash]


class DiskView:
    """One replica's side of a ``NodeDisk``: what ``KVCacheManager`` asks of a disk store (a
    ``replicas.kv.tiers.DiskIndex``) and what the simulated transfer asks."""

    def __init__(self, disk: NodeDisk, writer: int, read_s_per_block: float) -> None:
        self.disk = disk
        self.writer = writer
        self._read_s = read_s_per_block
        self._evictions = 0
        self._changes: list[tuple[bool, BlockHash]] | None = None  # None: not tracked

    @property
    def _own(self) -> OrderedDict[BlockHash, None]:
        return self.disk.slabs[self.writer]

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.disk.holders

    def discard(self, block_hash: BlockHash) -> None:
        if block_hash in self._own:
            del self._own[block_hash]
            self.disk._drop(block_hash)
            self._note(False, block_hash)

    def read_seconds_per_block(self) -> float:
        return self._read_s

    def store(self, block_hash: BlockHash, weight: float = 0.0) -> None:
        """Write a block into the own slab with its hit ``weight`` (the least recently used own
        block makes room when the slab is full)."""
        own = self._own
        if block_hash in own:
            own.move_to_end(block_hash)
            return
        if len(own) >= self.disk.slots_per_writer:
            evicted, _ = own.popitem(last=False)
            self.disk._drop(evicted)
            self._note(False, evicted)
            self._evictions += 1
        own[block_hash] = None
        self.disk._add(block_hash, weight)
        self._note(True, block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._own:
            self._own.move_to_end(block_hash)

    def clear(self) -> None:
        for block_hash in list(self._own):
            self.discard(block_hash)

    def hottest(self) -> list[BlockHash]:
        return self.disk.hottest()

    def track_changes(self) -> None:
        """Record the own slab's changes from now on, when the node ``announces`` them."""
        if self.disk.announces and self._changes is None:
            self._changes = [(True, h) for h in self._own]

    def drain_changes(self) -> list[tuple[bool, BlockHash]]:
        if self._changes is None:
            return []
        changes, self._changes = self._changes, []
        return changes

    def _note(self, stored: bool, block_hash: BlockHash) -> None:
        if self._changes is not None:
            self._changes.append((stored, block_hash))

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._own)

    def usage(self) -> TierUsage:
        return TierUsage(self.disk.slots_per_writer, 0, len(self._own), 0)

    def reset(self) -> list[BlockHash]:
        self.clear()  # announced through drain_changes
        return []

    # Traces carry no prompt-cache hints: the simulated disk retains nothing.
    def retain(self, block_hash: BlockHash, until: float) -> bool:
        return False

    def expire(self) -> None:
        return None

    num_retained = 0

    def stats(self) -> SimDiskStats:
        return SimDiskStats(self.disk.slots_per_writer, len(self._own), self._evictions)
