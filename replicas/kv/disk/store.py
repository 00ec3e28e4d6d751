"""``DiskStore``, the disk tier of one cache type as one replica sees it, and the model
fingerprint that names its directory. The store composes the pieces of the package (see
``replicas.kv.disk``) and runs their IO on one thread of its own.
"""

import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from replicas.kv.disk.changes import ChangeLog
from replicas.kv.disk.peers import PeerSlabs
from replicas.kv.disk.ranking import HeatRanking
from replicas.kv.disk.record import Heat, Location, checksum_seed
from replicas.kv.disk.slab import SlabFile
from replicas.kv.disk.slots import OwnSlots
from replicas.kv.disk.tenants import SlotTenants
from replicas.kv.free_block_queue import DECAY
from replicas.kv.hashing import BlockHash
from replicas.kv.records import TierUsage
from replicas.kv.tenants import NO_TENANT

logger = logging.getLogger(__name__)


class DiskStats(NamedTuple):
    """One store's counters (own slots; reads count every slab)."""

    num_slots: int
    num_cached: int  # own slots holding a block
    blocks_written: int
    blocks_read: int
    read_failures: int  # misses found at read time: checksum, changed slot, missing file
    evictions: int  # own blocks overwritten by newer ones
    bytes_written: int
    bytes_read: int
    read_seconds: float
    write_seconds: float
    enabled: bool  # False once a write failed: the replica runs without the disk tier


def model_fingerprint(
    model: torch.nn.Module, architecture: str, dtype: str, block_size: int
) -> str:
    """A digest of what decides a block's bytes: the architecture, every parameter and buffer
    (names, shapes, dtypes and values), the KV dtype and the block size."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(f"{architecture}|{dtype}|{block_size}".encode())
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tuple(data.shape)}|{data.dtype}".encode())
        if data.numel():
            digest.update(data.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class DiskStore:
    """The disk blocks of one cache type, as one replica sees them: its own slab (read and
    written) and every other slab of the directory (read). A ``replicas.kv.tiers.DiskIndex``.

    ``contains``, ``store``, ``load`` and ``discard`` are called by the engine thread only;
    the IO runs on the store's thread, in submission order. The store decides in memory
    (``OwnSlots``, ``PeerSlabs``, ``HeatRanking``) and hands the file work to ``SlabFile`` on
    that thread. ``retain``, ``expire``, ``usage`` and ``read_seconds_per_block`` answer the
    ``DiskIndex`` interface from the part that owns each."""

    def __init__(
        self,
        directory: str,
        fingerprint: str,
        cache_type: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        num_slots: int,
        *,
        max_retained: int = 0,
        retained_priority: str = DECAY,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``retained_priority``: how retained blocks are ordered in eviction, ``decay`` or
        ``pin`` (``OwnSlots``); ``clock`` times retention deadlines and last uses;
        ``wall_clock`` (shared by the node's processes) stamps hit weights."""
        if num_slots < 1:
            raise ValueError(f"a disk store needs at least one slot, got {num_slots}")
        self.max_retained = max_retained
        self.clock = clock
        self.wall_clock = wall_clock
        self.block_shape = block_shape
        self.dtype = dtype
        item_bytes = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = torch.Size(block_shape).numel() * item_bytes
        self.num_slots = num_slots
        shape = "x".join(map(str, block_shape))
        self.directory = os.path.join(directory, f"{fingerprint}-{cache_type}-{shape}")
        seed = checksum_seed(fingerprint, cache_type)
        self._file = SlabFile(self.directory, seed, self.block_bytes, num_slots)
        self._slots = OwnSlots(num_slots, max_retained, clock, retained_priority == DECAY)
        self.tenants: SlotTenants = self._slots.tenants  # blocks and quotas per tenant
        self._changes = ChangeLog()
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"kv-disk-{cache_type}")
        try:
            self._open()
        except OSError as error:
            self._file.disable(f"cannot open {self.directory}: {error}")
        self.slab = self._file.slab
        self._peers = PeerSlabs(self.directory, self.slab)
        self._ranking = HeatRanking(self._slots, self._peers, wall_clock)

    def retain(self, key: BlockHash, until: float) -> bool:
        return self._slots.retain(key, until)

    def expire(self) -> None:
        self._slots.expire()

    def usage(self) -> TierUsage:
        return self._slots.usage()

    def read_seconds_per_block(self) -> float:
        return self._file.read_seconds_per_block()

    def _open(self) -> None:
        """Take a slab, take back the blocks it held, size its files."""
        self._slots.restore(self._file.open())
        self._file.allocate()
        logger.info(
            "disk tier: %s slab %d, %d slots of %d bytes, %d blocks kept from before",
            self.directory,
            self._file.slab,
            self.num_slots,
            self.block_bytes,
            len(self._slots),
        )

    # ---- the engine thread's side --------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._file.enabled

    def contains(self, key: BlockHash) -> bool:
        """Whether some slab holds ``key`` as far as this store knows (a read may still miss)."""
        if not self._file.enabled:
            return False
        return key in self._slots or self._peers.locate(key) is not None

    def store(
        self,
        key: BlockHash,
        block: torch.Tensor,
        retained_until: float = 0.0,
        weight: float = 0.0,
        batch: bool = False,
        tenant: int = NO_TENANT,
    ) -> BlockHash | None:
        """Write ``block`` (a CPU tensor this store may keep until written) as ``key`` into an
        own slot, when none is free the least recently used batch one, else one of a tenant
        over its quota, else an ordinary one (``OwnSlots``), with its hit ``weight``, and
        retain it until ``retained_until`` if given; ``batch``: a block of the batch class,
        replaced before the others; ``tenant``: whose block it is (``replicas.kv.tenants``).
        Returns the key it replaced."""
        if not self._file.enabled:
            return None
        if key in self._slots:
            self._slots.touch(key, batch)
            self._slots.retain(key, retained_until)
            return None
        heat = Heat(weight, self.wall_clock())
        slot, generation, evicted = self._slots.take(key, heat, batch, tenant)
        if evicted is not None:
            self._changes.note(False, evicted)
        self._changes.note(True, key)
        self._io.submit(self._file.write, slot, key, generation, block, heat)
        self._slots.retain(key, retained_until)
        return evicted

    # ---- hotness (see the package docstring) ---------------------------------------------------
    def set_weight(self, key: BlockHash, weight: float) -> None:
        """Record a new hit weight for an own block (its record rewritten in place)."""
        if key not in self._slots or not self._file.enabled:
            return
        heat = Heat(weight, self.wall_clock())
        slot = self._slots.reweigh(key, heat)
        self._io.submit(self._file.write_heat, slot, key, heat)

    def hottest(self) -> list[BlockHash]:
        """Every key some slab holds, hottest first: by hit weight decayed to now, then the
        most recently weighed first."""
        if not self._file.enabled:
            return []
        peers = [k for k in self._peers.held_keys() if k not in self._slots]
        return self._ranking.hottest([*self._slots, *peers])

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free if self._file.enabled else 0

    def room_for(self, weights: list[float]) -> tuple[int, list[BlockHash]]:
        """How many new blocks of hit ``weights`` (hottest first) fit in the own slab without
        replacing a hotter block, and the own blocks they replace, coldest first (no mutation):
        each takes a free slot, else the slot of the coldest own ordinary block left if that
        is strictly colder. The caller ``forget``s those before its stores, so that the
        stores take their slots rather than the least recently used ones."""
        if not self._file.enabled:
            return 0, []
        return self._ranking.room_for(weights)

    # ---- retention, reads, forgetting ----------------------------------------------------------
    def load_many(self, keys: list[BlockHash], outs: list[torch.Tensor]) -> "Future[list[bool]]":
        """Read each key into its ``out`` (a contiguous CPU tensor of one block, untouched until
        the future is done), in one task of the IO thread; the future holds, per key in order,
        whether its ``out`` holds the block."""
        locations: list[Location | None] = []
        for key in keys:
            slot = self._slots.slot_of(key) if self._file.enabled else None
            if slot is not None:
                self._slots.touch(key)
                locations.append(Location(self.slab, slot, -1))  # -1: any generation of key
            else:
                locations.append(self._peers.locate(key) if self._file.enabled else None)
        return self._io.submit(self._file.read_many, locations, keys, outs)

    def discard(self, key: BlockHash) -> None:
        """Forget ``key`` after a failed read, so that it is not asked for again."""
        self.forget(key)
        self._peers.mark_bad(key)

    def forget(self, key: BlockHash) -> None:
        """Free an own block's slot (its record zeroed); no-op for another slab's block."""
        slot = self._slots.forget(key)
        if slot is not None:
            self._changes.note(False, key)
            self._io.submit(self._file.clear, slot)

    # ---- announcements -------------------------------------------------------------------------
    def track_changes(self) -> None:
        """Record which own blocks are stored and removed from now on, for ``drain_changes``;
        the blocks held already (kept from before a restart) count as stored now."""
        self._changes.track(list(self._slots) if self.enabled else [])

    def drain_changes(self) -> list[tuple[bool, BlockHash]]:
        """(stored, key) per change of the own blocks since the last call, in order; a store
        that turned itself off reports every own block removed, once."""
        if self._changes.tracking and not self._file.enabled and len(self._slots):
            self.clear()
        return self._changes.drain()

    def cached_hashes(self) -> list[BlockHash]:
        """The keys of this store's own slab, least recently used first: the blocks this
        replica announces (other slabs' are their writers')."""
        return list(self._slots) if self.enabled else []

    def reset(self) -> list[BlockHash]:
        """``clear``; its removals are announced through ``drain_changes``, so none returned."""
        self.clear()
        return []

    def stats(self) -> DiskStats:
        io = self._file.counts()
        return DiskStats(
            self.num_slots,
            len(self._slots),
            io.blocks_written,
            io.blocks_read,
            io.read_failures,
            self._slots.num_evicted,
            io.bytes_written,
            io.bytes_read,
            io.read_seconds,
            io.write_seconds,
            self._file.enabled,
        )

    def clear(self) -> None:
        """Forget every own block (the index records are zeroed; other slabs are untouched)."""
        for key in self._slots.clear():
            self._changes.note(False, key)
        self._io.submit(self._file.clear_all)

    # ---- the IO thread -------------------------------------------------------------------------
    def drop_page_cache(self) -> None:
        """Write the own slab out and ask the kernel to drop its cached pages, so that the next
        reads come from the device (for benchmarks; never on the step path)."""
        self.flush()
        self._file.drop_page_cache()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every write submitted so far, at most ``timeout`` seconds if given; returns
        whether they all landed."""
        try:
            self._io.submit(lambda: None).result(timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Finish the writes in flight and release the slab (another process may take it)."""
        self._io.shutdown(wait=True)
        self._file.close()
