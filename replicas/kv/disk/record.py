"""The disk tier's on-disk record format: one fixed-size index record per slot of a slab, the
checksum that ties a record to its payload, and the names of a slab's files.

Pure functions and value types, no IO: the slab file (``replicas.kv.disk.slab``) writes and
validates records, the own slot index and the peers' slabs learn blocks from them.
"""

import os
import struct
import zlib
from collections.abc import Iterator
from typing import NamedTuple

from replicas.kv.hashing import DIGEST_SIZE, BlockHash
from replicas.kv.hotness import decayed

RECORD = struct.Struct("<4sIQ16sIIfd")
"""One slot's index record: magic, format version, generation, key, checksum, payload bytes,
hit weight, wall-clock seconds the weight was taken at."""
HEAT = struct.Struct("<fd")
"""The record's last two fields (``set_weight`` rewrites them alone)."""
MAGIC = b"SKV1"
VERSION = 2


class Heat(NamedTuple):
    """A block's hit weight and the wall-clock seconds it was taken at."""

    weight: float
    written_at: float

    def now(self, wall_now: float) -> float:
        """The weight decayed to ``wall_now`` (``replicas.kv.hotness``)."""
        return decayed(self.weight, wall_now - self.written_at)


NO_HEAT = Heat(0.0, 0.0)
"""The heat of a block whose record carries none: never hit, weighed at the epoch."""


class Location(NamedTuple):
    """Where a block lies: a slab, a slot of it, and the generation its record had when it was
    found (-1 for an own slot, where any generation holding the key will do)."""

    slab: int
    slot: int
    generation: int


class Record(NamedTuple):
    """A valid index record's fields."""

    generation: int
    key: BlockHash
    checksum: int
    length: int
    heat: Heat


class Recovered(NamedTuple):
    """A valid record found in the own index at start-up: the block a slot held before."""

    generation: int
    slot: int
    key: BlockHash
    heat: Heat


def pack_record(generation: int, key: BlockHash, checksum: int, length: int, heat: Heat) -> bytes:
    """A record's bytes, as written last of a slot's three writes."""
    return RECORD.pack(MAGIC, VERSION, generation, key, checksum, length, *heat)


def parse_record(data: bytes) -> Record | None:
    """A valid record's fields, None for an empty or foreign one (or too few bytes)."""
    if len(data) != RECORD.size:
        return None
    magic, version, generation, key, checksum, length, weight, written_at = RECORD.unpack(data)
    if magic != MAGIC or version != VERSION:
        return None
    return Record(generation, key[:DIGEST_SIZE], checksum, length, Heat(weight, written_at))


def parse_index(data: bytes) -> Iterator[Record | None]:
    """A record or None per whole slot of an index file's bytes, slot 0 first."""
    for start in range(0, len(data) - RECORD.size + 1, RECORD.size):
        yield parse_record(data[start : start + RECORD.size])


def checksum_seed(fingerprint: str, cache_type: str) -> int:
    """The crc32 every checksum of a directory starts from, so that a record checks out only
    for the model and cache type that wrote it."""
    return zlib.crc32(f"{fingerprint}|{cache_type}".encode())


def checksum(seed: int, key: BlockHash, payload) -> int:
    """The crc32 of (fingerprint, key, payload) a record carries; ``payload`` is any buffer."""
    return zlib.crc32(payload, zlib.crc32(key, seed))


def slab_path(directory: str, slab: int, kind: str) -> str:
    """A slab's file of ``kind`` (``kv``, ``idx`` or ``lock``) in ``directory``."""
    return os.path.join(directory, f"slab-{slab}.{kind}")


def slab_number(name: str) -> int | None:
    """The slab an index file's name (``slab-K.idx``) belongs to, None for any other name."""
    if not (name.startswith("slab-") and name.endswith(".idx")):
        return None
    try:
        return int(name[5:-4])
    except ValueError:
        return None
