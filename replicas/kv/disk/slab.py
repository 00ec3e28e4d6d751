"""A replica's own slab files on disk and every read of a slab: the lock that makes a slab
one process's, its preallocated payload file and index file, the three ordered writes of a
slot, validated reads (own slab and others'), the IO counters, and the switch that turns the
tier off on the first write failure.

Its write, clear and read methods run on the store's IO thread, one at a time in submission
order (``replicas.kv.disk.store.DiskStore`` submits them); they never raise: a failed write
turns the files off with one warning, a failed read is a miss.
"""

import fcntl
import logging
import os
import threading
import time
from typing import NamedTuple

import torch

from replicas.kv.disk.record import (
    HEAT,
    RECORD,
    Heat,
    Location,
    Recovered,
    checksum,
    pack_record,
    parse_index,
    parse_record,
    slab_path,
)
from replicas.kv.hashing import BlockHash

logger = logging.getLogger(__name__)

MAX_SLABS = 1024
"""Slab numbers a store tries when it looks for one that no running process writes."""
DEFAULT_READ_S_PER_BYTE = 1 / 1e9
"""Read cost assumed until the store has timed its own reads: 1 GB/s."""


class IOCounts(NamedTuple):
    """What the slab's IO did so far: blocks and bytes written and read, reads that missed,
    and the seconds spent writing and reading."""

    blocks_written: int
    blocks_read: int
    read_failures: int  # misses found at read time: checksum, changed slot, missing file
    bytes_written: int
    bytes_read: int
    read_seconds: float
    write_seconds: float


class SlabFile:
    """One replica's slab in ``directory`` (written) and its reads of every slab there.

    ``open`` takes the lowest slab no running process holds; ``allocate`` sizes its files.
    Until then, and after any failure to open or write, the files are off (``enabled``)."""

    def __init__(self, directory: str, seed: int, block_bytes: int, num_slots: int) -> None:
        """``seed`` starts every checksum (``record.checksum_seed``)."""
        self.directory = directory
        self.seed = seed
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.slab = -1
        self._lock_fd = self._slab_fd = self._index_fd = -1
        self._disabled: str | None = None
        self._warned = False
        self._stat_lock = threading.Lock()
        self._counts = {"written": 0, "read": 0, "failed": 0}
        self._bytes = {"written": 0, "read": 0}
        self._seconds = {"read": 0.0, "write": 0.0}

    # ---- opening (the engine thread, at start-up) ----------------------------------------------
    def open(self) -> list[Recovered]:
        """Lock a free slab and open its files; the blocks its index held before (a restart),
        oldest generation first. Raises ``OSError``."""
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
        return self._recovered()

    def _recovered(self) -> list[Recovered]:
        """The valid records of slots that fit both the slot count and the payload file;
        records past the slot count (the slab shrank) are zeroed."""
        size = os.fstat(self._index_fd).st_size
        data = os.pread(self._index_fd, size, 0) if size else b""
        slab_size = os.fstat(self._slab_fd).st_size
        found = []
        for slot, record in enumerate(parse_index(data)):
            if slot >= self.num_slots:
                os.pwrite(self._index_fd, bytes(RECORD.size), slot * RECORD.size)
                continue
            if record is None or (slot + 1) * self.block_bytes > slab_size:
                continue
            found.append(Recovered(record.generation, slot, record.key, record.heat))
        return sorted(found)

    def allocate(self) -> None:
        """Size the payload file to exactly the slots (preallocated) and the index to match.
        Raises ``OSError``."""
        slab_bytes = self.num_slots * self.block_bytes
        if os.fstat(self._slab_fd).st_size > slab_bytes:
            os.ftruncate(self._slab_fd, slab_bytes)
        os.posix_fallocate(self._slab_fd, 0, slab_bytes)
        os.ftruncate(self._index_fd, self.num_slots * RECORD.size)

    def _path(self, slab: int, kind: str) -> str:
        return slab_path(self.directory, slab, kind)

    @property
    def enabled(self) -> bool:
        """Whether the files opened and no write failed since."""
        return self._disabled is None

    def disable(self, reason: str) -> None:
        """Turn the files off (writes skipped from now on), warning once."""
        self._disabled = reason
        if not self._warned:
            self._warned = True
            logger.warning("disk tier off, going on with NPU and host tiers: %s", reason)

    # ---- writes (the IO thread) ----------------------------------------------------------------
    def write(
        self, slot: int, key: BlockHash, generation: int, block: torch.Tensor, heat: Heat
    ) -> None:
        """Overwrite ``slot`` with ``block`` as ``key``: record zeroed, payload, new record."""
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
            check = checksum(self.seed, key, payload)
            record = pack_record(generation, key, check, self.block_bytes, heat)
            os.pwrite(self._index_fd, record, offset)
        except OSError as error:
            self.disable(f"writing {self._path(self.slab, 'kv')} failed: {error}")
            return
        with self._stat_lock:
            self._counts["written"] += 1
            self._bytes["written"] += self.block_bytes
            self._seconds["write"] += time.perf_counter() - start

    def write_heat(self, slot: int, key: BlockHash, heat: Heat) -> None:
        """Rewrite a record's hit weight, if the slot still holds ``key``."""
        if self._disabled is not None:
            return
        offset = slot * RECORD.size
        try:
            record = parse_record(os.pread(self._index_fd, RECORD.size, offset))
            if record is not None and record.key == key:
                os.pwrite(self._index_fd, HEAT.pack(*heat), offset + RECORD.size - HEAT.size)
        except OSError as error:
            self.disable(f"writing {self._path(self.slab, 'idx')} failed: {error}")

    def clear(self, slot: int) -> None:
        """Zero one slot's record (its block is gone for every reader)."""
        self._zero(bytes(RECORD.size), slot * RECORD.size)

    def clear_all(self) -> None:
        """Zero every record of the own index."""
        self._zero(bytes(self.num_slots * RECORD.size), 0)

    def _zero(self, zeros: bytes, offset: int) -> None:
        try:
            os.pwrite(self._index_fd, zeros, offset)
        except OSError as error:
            self.disable(f"writing {self._path(self.slab, 'idx')} failed: {error}")

    # ---- reads (the IO thread) -----------------------------------------------------------------
    def read_many(
        self, locations: list[Location | None], keys: list[BlockHash], outs: list[torch.Tensor]
    ) -> list[bool]:
        """``read`` per key into its ``out``; a key without a location is a miss."""
        return [
            location is not None and self.read(location, key, out)
            for location, key, out in zip(locations, keys, outs)
        ]

    def read(self, location: Location, key: BlockHash, out: torch.Tensor) -> bool:
        """Read ``key`` at ``location`` into ``out``, timed and counted; False on any miss."""
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

    def _read_checked(self, location: Location, key: BlockHash, out: torch.Tensor) -> bool:
        """Record, payload, checksum, record again: a changed generation, a bad checksum or a
        short read is False, never a wrong block."""
        own = location.slab == self.slab
        index_fd = self._index_fd if own else os.open(self._path(location.slab, "idx"), os.O_RDONLY)
        slab_fd = self._slab_fd if own else os.open(self._path(location.slab, "kv"), os.O_RDONLY)
        try:
            offset = location.slot * RECORD.size
            before = parse_record(os.pread(index_fd, RECORD.size, offset))
            if before is None or before.key != key:
                return False
            if location.generation >= 0 and before.generation != location.generation:
                return False
            length = before.length
            if length != self.block_bytes or out.numel() * out.element_size() != length:
                return False
            buffer = out.reshape(-1).view(torch.uint8).numpy()
            if os.preadv(slab_fd, [buffer], location.slot * self.block_bytes) != length:
                return False
            if checksum(self.seed, key, buffer) != before.checksum:
                return False
            after = parse_record(os.pread(index_fd, RECORD.size, offset))
            return after is not None and after.generation == before.generation and after.key == key
        finally:
            if not own:
                os.close(index_fd)
                os.close(slab_fd)

    # ---- counters and the end ------------------------------------------------------------------
    def counts(self) -> IOCounts:
        """The IO counters, as of now (any thread)."""
        with self._stat_lock:
            counts, nbytes, seconds = dict(self._counts), dict(self._bytes), dict(self._seconds)
        return IOCounts(
            counts["written"],
            counts["read"],
            counts["failed"],
            nbytes["written"],
            nbytes["read"],
            seconds["read"],
            seconds["write"],
        )

    def read_seconds_per_block(self) -> float:
        """Measured seconds per block read (a default of 1 GB/s until a read was timed)."""
        with self._stat_lock:
            num_read = self._counts["read"]
            seconds = self._seconds["read"]
        if num_read == 0:
            return self.block_bytes * DEFAULT_READ_S_PER_BYTE
        return seconds / num_read

    def drop_page_cache(self) -> None:
        """Write the payload file out and drop its cached pages (no-op when off)."""
        if self._disabled is None:
            os.fdatasync(self._slab_fd)
            os.posix_fadvise(self._slab_fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close the files and release the slab (another process may take it)."""
        for fd in (self._slab_fd, self._index_fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._slab_fd = self._index_fd = self._lock_fd = -1
