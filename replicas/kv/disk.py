"""The disk tier: KV blocks in files on a local disk, kept across restarts and shared by the
replicas of one node.

Layout: one directory per model fingerprint and cache type under the configured path; in it,
each replica that writes owns one *slab* (a preallocated file of fixed-size slots) and its
*index* (one fixed-size record per slot)::

    <disk_path>/<fingerprint>-<cache type>/
        slab-0.lock   flock'ed by the replica that writes slab 0 while it runs
        slab-0.kv     num_slots x block bytes, preallocated
        slab-0.idx    num_slots x RECORD.size: magic, generation, key, checksum, hit weight
        slab-1.*      another replica's (or another process's) slab, read by everyone

The fingerprint (``model_fingerprint``) covers the architecture, a checksum of every weight,
the dtype, the block size and the cache type's block shape, so a restart of the same model finds
its blocks again and a different model or block size never reads them.

Writes go through one IO thread per store and never ``fsync``: a block that a crash tore is
caught by its checksum. A slot is overwritten in three ordered writes, so that a reader of
another process sees either the old block, the new block or a miss::

    1. the slot's index record is zeroed      (readers stop finding the old block)
    2. the payload is written into the slot
    3. the record is written: key, a new generation, crc32 of (fingerprint, key, payload), and
       the block's hit weight with the wall-clock time it was taken at

A read takes the record, reads the payload, checks the checksum, and reads the record again: a
changed generation (the owner reused the slot meanwhile), a bad checksum, a short read or a
missing file is a miss, never a wrong block. Every failure to write (a full or read-only disk)
turns the store off with one warning: the replica goes on as a two-tier cache.

A replica's own slots are LRU within its share of the byte budget; other slabs are read-only to
it and learned by re-reading their index files (at most every ``PEER_REFRESH_S``). Up to
``max_retained`` own blocks may be *retained* until a deadline (``retain``): eviction skips them
(each skipped one moves to the back) while an ordinary block is left, and an expired one is
ordinary again. Deadlines live in memory only: after a restart every block is ordinary.

**Hotness.** Each record keeps the block's hit weight (``replicas.kv.hotness``) when it was
written and the wall-clock time of that weight, so that any replica of the node ranks every
slab's blocks by their weight decayed to now (``hottest``): a replica starting on the node loads
the hottest first. Wall-clock time, because replicas are separate processes whose monotonic
clocks do not agree; the weight, not the time of last use, because it tells a block hit by
every request apart from one used once just before. ``set_weight`` refreshes an own record's
weight in place (its generation and checksum unchanged: readers still see the same block), and
``room_for`` tells how many hotter blocks the own slab takes and which colder ones they replace,
never a hotter block by a colder one.
"""

import fcntl
import hashlib
import heapq
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from replicas.kv.hashing import DIGEST_SIZE, BlockHash
from replicas.kv.hotness import decayed
from replicas.kv.records import TierUsage

logger = logging.getLogger(__name__)

RECORD = struct.Struct("<4sIQ16sIIfd")
"""One slot's index record: magic, format version, generation, key, checksum, payload bytes,
hit weight, wall-clock seconds the weight was taken at."""
HEAT = struct.Struct("<fd")
"""The record's last two fields (``set_weight`` rewrites them alone)."""
MAGIC = b"SKV1"
VERSION = 2
MAX_SLABS = 1024
"""Slab numbers a store tries when it looks for one that no running process writes."""
PEER_REFRESH_S = 0.25
"""Least seconds between two re-reads of the other slabs' index files."""
DEFAULT_READ_S_PER_BYTE = 1 / 1e9
"""Read cost assumed until the store has timed its own reads: 1 GB/s."""


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


class _Location(NamedTuple):
    slab: int
    slot: int
    generation: int


class _Heat(NamedTuple):
    """A block's hit weight and the wall-clock seconds it was taken at."""

    weight: float
    written_at: float

    def now(self, wall_now: float) -> float:
        return decayed(self.weight, wall_now - self.written_at)


class DiskStore:
    """The disk blocks of one cache type, as one replica sees them: its own slab (read and
    written) and every other slab of the directory (read). A ``replicas.kv.tiers.DiskIndex``.

    ``contains``, ``store``, ``load`` and ``discard`` are called by the engine thread only;
    the IO runs on the store's thread, in submission order."""

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
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock`` times retention deadlines; ``wall_clock`` (shared by the node's processes)
        stamps hit weights."""
        if num_slots < 1:
            raise ValueError(f"a disk store needs at least one slot, got {num_slots}")
        self.max_retained = max_retained
        self.clock = clock
        self.wall_clock = wall_clock
        self._retained: dict[BlockHash, float] = {}  # own key -> deadline on ``clock``
        self._deadlines: list[tuple[float, BlockHash]] = []  # heap; stale entries skipped
        self.block_shape = block_shape
        self.dtype = dtype
        item_bytes = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = torch.Size(block_shape).numel() * item_bytes
        self.num_slots = num_slots
        shape = "x".join(map(str, block_shape))
        self.directory = os.path.join(directory, f"{fingerprint}-{cache_type}-{shape}")
        self._seed = zlib.crc32(f"{fingerprint}|{cache_type}".encode())
        self._own: OrderedDict[BlockHash, int] = OrderedDict()  # key -> slot, oldest first
        self._slot_keys: list[BlockHash | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._generation = 0
        self._peers: dict[BlockHash, _Location] = {}
        self._heat: dict[BlockHash, _Heat] = {}  # own keys'
        self._peer_heat: dict[BlockHash, _Heat] = {}
        self._peer_files: dict[int, tuple[int, int]] = {}  # slab -> (mtime_ns, size) read
        self._peer_checked = 0.0
        self._bad: set[_Location] = set()  # peer blocks that failed a read
        self._disabled: str | None = None
        self._warned = False
        self._changes: list[tuple[bool, BlockHash]] | None = None  # (stored?, key), when tracked
        self._lock_fd = self._slab_fd = self._index_fd = -1
        self.slab = -1
        self._counts = {"written": 0, "read": 0, "failed": 0, "evicted": 0}
        self._bytes = {"written": 0, "read": 0}
        self._seconds = {"read": 0.0, "write": 0.0}
        self._stat_lock = threading.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"kv-disk-{cache_type}")
        try:
            self._open()
        except OSError as error:
            self._disable(f"cannot open {self.directory}: {error}")

    # ---- opening -----------------------------------------------------------------------------
    def _open(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for slab in range(MAX_SLABS):
            fd = os.open(self._path(slab, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd, self.slab = fd, slab
            break
        else:
            raise OSError(f"all {MAX_SLABS} slabs are written by running processes")
        self._slab_fd = os.open(self._path(self.slab, "kv"), os.O_RDWR | os.O_CREAT, 0o644)
        self._index_fd = os.open(self._path(self.slab, "idx"), os.O_RDWR | os.O_CREAT, 0o644)
        self._recover()
        slab_bytes = self.num_slots * self.block_bytes
        if os.fstat(self._slab_fd).st_size > slab_bytes:
            os.ftruncate(self._slab_fd, slab_bytes)
        os.posix_fallocate(self._slab_fd, 0, slab_bytes)
        os.ftruncate(self._index_fd, self.num_slots * RECORD.size)
        logger.info(
            "disk tier: %s slab %d, %d slots of %d bytes, %d blocks kept from before",
            self.directory,
            self.slab,
            self.num_slots,
            self.block_bytes,
            len(self._own),
        )

    def _recover(self) -> None:
        """Take back the blocks this slab held before (a restart), newest kept when the slab
        shrank to fewer slots."""
        data = _read_all(self._index_fd)
        slab_size = os.fstat(self._slab_fd).st_size
        found = []
        for slot, record in enumerate(_records(data)):
            if slot >= self.num_slots:
                os.pwrite(self._index_fd, bytes(RECORD.size), slot * RECORD.size)
                continue
            if record is None or (slot + 1) * self.block_bytes > slab_size:
                continue
            generation, key, heat = record
            found.append((generation, slot, key, heat))
        for generation, slot, key, heat in sorted(found):
            if key in self._own:  # an older copy of the same block: its slot is free
                old = self._own.pop(key)
                self._slot_keys[old] = None
            self._own[key] = slot
            self._slot_keys[slot] = key
            self._heat[key] = heat
            self._generation = max(self._generation, generation)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if self._slot_keys[s] is None]

    def _path(self, slab: int, kind: str) -> str:
        return os.path.join(self.directory, f"slab-{slab}.{kind}")

    # ---- the engine thread's side --------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._disabled is None

    def contains(self, key: BlockHash) -> bool:
        """Whether some slab holds ``key`` as far as this store knows (a read may still miss)."""
        if self._disabled is not None:
            return False
        if key in self._own:
            return True
        self._refresh_peers()
        location = self._peers.get(key)
        return location is not None and location not in self._bad

    def store(
        self,
        key: BlockHash,
        block: torch.Tensor,
        retained_until: float = 0.0,
        weight: float = 0.0,
    ) -> BlockHash | None:
        """Write ``block`` (a CPU tensor this store may keep until written) as ``key`` into an
        own slot, the least recently used ordinary one when none is free, with its hit
        ``weight``, and retain it until ``retained_until`` if given; returns the key it
        replaced."""
        if self._disabled is not None:
            return None
        if key in self._own:
            self._own.move_to_end(key)
            self.retain(key, retained_until)
            return None
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self._evictee()
            slot = self._own.pop(evicted)
            self._retained.pop(evicted, None)
            self._heat.pop(evicted, None)
            self._note(False, evicted)
            with self._stat_lock:
                self._counts["evicted"] += 1
        self._note(True, key)
        self._own[key] = slot
        self._slot_keys[slot] = key
        self._generation += 1
        heat = self._heat[key] = _Heat(weight, self.wall_clock())
        self._io.submit(self._write, slot, key, self._generation, block, heat)
        self.retain(key, retained_until)
        return evicted

    # ---- hotness (see the module docstring) ----------------------------------------------------
    def weight(self, key: BlockHash) -> float:
        """The hit weight some slab recorded for ``key``, decayed to now (0.0 if unknown)."""
        heat = self._heat.get(key) or self._peer_heat.get(key)
        return 0.0 if heat is None else heat.now(self.wall_clock())

    def set_weight(self, key: BlockHash, weight: float) -> None:
        """Record a new hit weight for an own block (its record rewritten in place)."""
        slot = self._own.get(key)
        if slot is None or self._disabled is not None:
            return
        heat = self._heat[key] = _Heat(weight, self.wall_clock())
        self._io.submit(self._write_heat, slot, key, heat)

    def hottest(self) -> list[BlockHash]:
        """Every key some slab holds, hottest first: by hit weight decayed to now, then the
        most recently weighed first."""
        keys = self.keys()
        now = self.wall_clock()
        unknown = _Heat(0.0, 0.0)

        def rank(key: BlockHash) -> tuple[float, float]:
            heat = self._heat.get(key) or self._peer_heat.get(key) or unknown
            return heat.now(now), heat.written_at

        return sorted(keys, key=rank, reverse=True)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) if self._disabled is None else 0

    def room_for(self, weights: list[float]) -> tuple[int, list[BlockHash]]:
        """How many new blocks of hit ``weights`` (hottest first) fit in the own slab without
        replacing a hotter block, and the own blocks they replace, coldest first (no mutation):
        each takes a free slot, else the slot of the coldest own ordinary block left if that
        is strictly colder. The caller ``forget``s those before its stores, so that the
        stores take their slots rather than the least recently used ones."""
        if self._disabled is not None:
            return 0, []
        self.expire()
        now = self.wall_clock()
        colder = sorted(
            (self._heat.get(k, _Heat(0.0, 0.0)).now(now), k)
            for k in self._own
            if k not in self._retained
        )
        num_free = len(self._free)
        num_fit = num_replaced = 0
        for weight in weights:
            if num_free:
                num_free -= 1
            elif num_replaced < len(colder) and colder[num_replaced][0] < weight:
                num_replaced += 1
            else:
                break
            num_fit += 1
        return num_fit, [key for _, key in colder[:num_replaced]]

    def retain(self, key: BlockHash, until: float) -> bool:
        """Keep an own block ahead of ordinary ones until ``until`` (a later deadline extends
        it); False when it is not an own block or ``max_retained`` are retained already."""
        if until <= 0.0 or key not in self._own:
            return False
        if key in self._retained:
            self._retained[key] = max(self._retained[key], until)  # its heap entry follows
            return True
        self.expire()
        if len(self._retained) >= self.max_retained:
            return False
        self._retained[key] = until
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

    def _evictee(self) -> BlockHash:
        """The own block a store replaces: the least recently used ordinary one; retained ones
        met on the way move to the back. Only when every own block is retained, the least
        recently used of them."""
        if self._retained:
            self.expire()
        for _ in range(len(self._own)):
            key = next(iter(self._own))
            if key not in self._retained:
                return key
            self._own.move_to_end(key)
        return next(iter(self._own))

    def load_many(self, keys: list[BlockHash], outs: list[torch.Tensor]) -> "Future[list[bool]]":
        """Read each key into its ``out`` (a contiguous CPU tensor of one block, untouched until
        the future is done), in one task of the IO thread; the future holds, per key in order,
        whether its ``out`` holds the block."""
        locations = []
        for key in keys:
            location = self._locate(key)
            if location is not None and location.slab == self.slab:
                self._own.move_to_end(key)
            locations.append(location)
        return self._io.submit(self._read_many, locations, keys, outs)

    def discard(self, key: BlockHash) -> None:
        """Forget ``key`` after a failed read, so that it is not asked for again."""
        self.forget(key)
        location = self._peers.get(key)
        if location is not None:
            self._bad.add(location)

    def forget(self, key: BlockHash) -> None:
        """Free an own block's slot (its record zeroed); no-op for another slab's block."""
        slot = self._own.pop(key, None)
        self._retained.pop(key, None)
        self._heat.pop(key, None)
        if slot is not None:
            self._note(False, key)
            self._slot_keys[slot] = None
            self._free.append(slot)
            self._io.submit(self._clear, slot)

    def track_changes(self) -> None:
        """Record which own blocks are stored and removed from now on, for ``drain_changes``;
        the blocks held already (kept from before a restart) count as stored now."""
        if self._changes is None:
            self._changes = [(True, key) for key in self._own] if self.enabled else []

    def drain_changes(self) -> list[tuple[bool, BlockHash]]:
        """(stored, key) per change of the own blocks since the last call, in order; a store
        that turned itself off reports every own block removed, once."""
        if self._changes is None:
            return []
        if self._disabled is not None and self._own:
            self.clear()
        changes, self._changes = self._changes, []
        return changes

    def cached_hashes(self) -> list[BlockHash]:
        """The keys of this store's own slab, least recently used first: the blocks this
        replica announces (other slabs' are their writers')."""
        return list(self._own) if self.enabled else []

    def usage(self) -> TierUsage:
        """The own slab: slots, none in use (a read copies out at once), cached, retained."""
        return TierUsage(self.num_slots, 0, len(self._own), len(self._retained))

    def reset(self) -> list[BlockHash]:
        """``clear``; its removals are announced through ``drain_changes``, so none returned."""
        self.clear()
        return []

    def _note(self, stored: bool, key: BlockHash) -> None:
        if self._changes is not None:
            self._changes.append((stored, key))

    def keys(self) -> list[BlockHash]:
        """Every key some slab holds, own first (for a snapshot a router learns from)."""
        if self._disabled is not None:
            return []
        self._refresh_peers(force=True)
        peers = [k for k, loc in self._peers.items() if k not in self._own and loc not in self._bad]
        return [*self._own, *peers]

    def read_seconds_per_block(self) -> float:
        """Measured seconds per block read (a default of 1 GB/s until a read was timed)."""
        with self._stat_lock:
            num_read = self._counts["read"]
            seconds = self._seconds["read"]
        if num_read == 0:
            return self.block_bytes * DEFAULT_READ_S_PER_BYTE
        return seconds / num_read

    def stats(self) -> DiskStats:
        with self._stat_lock:
            counts, nbytes, seconds = dict(self._counts), dict(self._bytes), dict(self._seconds)
        return DiskStats(
            self.num_slots,
            len(self._own),
            counts["written"],
            counts["read"],
            counts["failed"],
            counts["evicted"],
            nbytes["written"],
            nbytes["read"],
            seconds["read"],
            seconds["write"],
            self._disabled is None,
        )

    def clear(self) -> None:
        """Forget every own block (the index records are zeroed; other slabs are untouched)."""
        for key in self._own:
            self._note(False, key)
        self._own.clear()
        self._retained.clear()
        self._heat.clear()
        self._slot_keys = [None] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._io.submit(self._clear_all)

    def drop_page_cache(self) -> None:
        """Write the own slab out and ask the kernel to drop its cached pages, so that the next
        reads come from the device (for benchmarks; never on the step path)."""
        self.flush()
        if self._disabled is None:
            os.fdatasync(self._slab_fd)
            os.posix_fadvise(self._slab_fd, 0, 0, os.POSIX_FADV_DONTNEED)

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
        for fd in (self._slab_fd, self._index_fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._slab_fd = self._index_fd = self._lock_fd = -1

    def _locate(self, key: BlockHash) -> _Location | None:
        if self._disabled is not None:
            return None
        slot = self._own.get(key)
        if slot is not None:
            return _Location(self.slab, slot, -1)  # -1: own slot, any generation with this key
        self._refresh_peers()
        location = self._peers.get(key)
        return None if location is None or location in self._bad else location

    def _refresh_peers(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._peer_checked < PEER_REFRESH_S:
            return
        self._peer_checked = now
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        seen = set()
        changed = False
        for name in names:
            if not (name.startswith("slab-") and name.endswith(".idx")):
                continue
            try:
                slab = int(name[5:-4])
            except ValueError:
                continue
            if slab == self.slab:
                continue
            seen.add(slab)
            try:
                stat = os.stat(os.path.join(self.directory, name))
            except OSError:
                continue
            if self._peer_files.get(slab) != (stat.st_mtime_ns, stat.st_size):
                self._peer_files[slab] = (stat.st_mtime_ns, stat.st_size)
                changed = True
        for slab in set(self._peer_files) - seen:
            del self._peer_files[slab]
            changed = True
        if changed:
            self._peer_heat = {}
            self._peers = self._read_peers()

    def _read_peers(self) -> dict[BlockHash, _Location]:
        peers: dict[BlockHash, _Location] = {}
        for slab in sorted(self._peer_files):
            try:
                with open(self._path(slab, "idx"), "rb") as file:
                    data = file.read()
            except OSError:
                continue
            for slot, record in enumerate(_records(data)):
                if record is not None:
                    generation, key, heat = record
                    if key not in peers:
                        peers[key] = _Location(slab, slot, generation)
                        self._peer_heat[key] = heat
        return peers

    def _disable(self, reason: str) -> None:
        self._disabled = reason
        if not self._warned:
            self._warned = True
            logger.warning("disk tier off, going on with NPU and host tiers: %s", reason)

    # ---- the IO thread's side ----------------------------------------------------------------
    def _write(
        self, slot: int, key: BlockHash, generation: int, block: torch.Tensor, heat: _Heat
    ) -> None:
        if self._disabled is not None:
            return
        start = time.perf_counter()
        payload = block.reshape(-1).view(torch.uint8).numpy()
        try:
            offset = slot * RECORD.size
            os.pwrite(self._index_fd, bytes(RECORD.size), offset)
            written = os.pwrite(self._slab_fd, payload, slot * self.block_bytes)
            if written != self.block_bytes:
                raise OSError(f"short write of {written} of {self.block_bytes} bytes")
            checksum = zlib.crc32(payload, zlib.crc32(key, self._seed))
            record = RECORD.pack(MAGIC, VERSION, generation, key, checksum, self.block_bytes, *heat)
            os.pwrite(self._index_fd, record, offset)
        except OSError as error:
            self._disable(f"writing {self._path(self.slab, 'kv')} failed: {error}")
            return
        with self._stat_lock:
            self._counts["written"] += 1
            self._bytes["written"] += self.block_bytes
            self._seconds["write"] += time.perf_counter() - start

    def _write_heat(self, slot: int, key: BlockHash, heat: _Heat) -> None:
        """Rewrite a record's hit weight, if the slot still holds ``key``."""
        if self._disabled is not None:
            return
        offset = slot * RECORD.size
        try:
            record = _record(os.pread(self._index_fd, RECORD.size, offset))
            if record is not None and record.key == key:
                os.pwrite(self._index_fd, HEAT.pack(*heat), offset + RECORD.size - HEAT.size)
        except OSError as error:
            self._disable(f"writing {self._path(self.slab, 'idx')} failed: {error}")

    def _clear_all(self) -> None:
        try:
            os.pwrite(self._index_fd, bytes(self.num_slots * RECORD.size), 0)
        except OSError as error:
            self._disable(f"writing {self._path(self.slab, 'idx')} failed: {error}")

    def _clear(self, slot: int) -> None:
        try:
            os.pwrite(self._index_fd, bytes(RECORD.size), slot * RECORD.size)
        except OSError as error:
            self._disable(f"writing {self._path(self.slab, 'idx')} failed: {error}")

    def _read_many(
        self, locations: list[_Location | None], keys: list[BlockHash], outs: list[torch.Tensor]
    ) -> list[bool]:
        return [
            location is not None and self._read(location, key, out)
            for location, key, out in zip(locations, keys, outs)
        ]

    def _read(self, location: _Location, key: BlockHash, out: torch.Tensor) -> bool:
        start = time.perf_counter()
        try:
            ok = self._read_checked(location, key, out)
        except OSError:
            ok = False
        with self._stat_lock:
            if ok:
                self._counts["read"] += 1
                self._bytes["read"] += self.block_bytes
                self._seconds["read"] += time.perf_counter() - start
            else:
                self._counts["failed"] += 1
        return ok

    def _read_checked(self, location: _Location, key: BlockHash, out: torch.Tensor) -> bool:
        own = location.slab == self.slab
        index_fd = self._index_fd if own else os.open(self._path(location.slab, "idx"), os.O_RDONLY)
        slab_fd = self._slab_fd if own else os.open(self._path(location.slab, "kv"), os.O_RDONLY)
        try:
            offset = location.slot * RECORD.size
            before = _record(os.pread(index_fd, RECORD.size, offset))
            if before is None or before[1] != key:
                return False
            generation, _, checksum, length = before[0], before[1], before[2], before[3]
            if location.generation >= 0 and generation != location.generation:
                return False
            if length != self.block_bytes or out.numel() * out.element_size() != length:
                return False
            buffer = out.reshape(-1).view(torch.uint8).numpy()
            if os.preadv(slab_fd, [buffer], location.slot * self.block_bytes) != length:
                return False
            if zlib.crc32(buffer, zlib.crc32(key, self._seed)) != checksum:
                return False
            after = _record(os.pread(index_fd, RECORD.size, offset))
            return after is not None and after[0] == generation and after[1] == key
        finally:
            if not own:
                os.close(index_fd)
                os.close(slab_fd)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


class _Record(NamedTuple):
    generation: int
    key: BlockHash
    checksum: int
    length: int
    heat: _Heat


def _record(data: bytes) -> _Record | None:
    """A valid record's fields, None for an empty or foreign one."""
    if len(data) != RECORD.size:
        return None
    magic, version, generation, key, checksum, length, weight, written_at = RECORD.unpack(data)
    if magic != MAGIC or version != VERSION:
        return None
    return _Record(generation, key[:DIGEST_SIZE], checksum, length, _Heat(weight, written_at))


def _records(data: bytes):
    """(generation, key, heat) or None per slot of an index file's bytes."""
    for start in range(0, len(data) - RECORD.size + 1, RECORD.size):
        record = _record(data[start : start + RECORD.size])
        yield None if record is None else (record.generation, record.key, record.heat)
