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

**Layout of the package.** Each concern has one owner: ``record`` (the index record, its
checksum, the files' names; no IO), ``slab.SlabFile`` (the own slab's files: lock, the three
ordered writes, validated reads of any slab, IO counters, the switch that turns the tier off),
``slots.OwnSlots`` (the own slab's slot index: LRU, free slots, generations, hit weights and
retention deadlines, in memory), ``peers.PeerSlabs`` (the other slabs, re-read from their index
files), ``ranking.HeatRanking`` (``hottest``, ``room_for`` and ``weight`` over both) and
``changes.ChangeLog`` (the own blocks' stores and removals the replica announces).
``store.DiskStore`` composes them and runs the IO thread; the public names are re-exported here.
"""

from replicas.kv.disk.peers import PEER_REFRESH_S
from replicas.kv.disk.record import HEAT, MAGIC, RECORD, VERSION
from replicas.kv.disk.slab import DEFAULT_READ_S_PER_BYTE, MAX_SLABS
from replicas.kv.disk.store import DiskStats, DiskStore, model_fingerprint

__all__ = [
    "DEFAULT_READ_S_PER_BYTE",
    "HEAT",
    "MAGIC",
    "MAX_SLABS",
    "PEER_REFRESH_S",
    "RECORD",
    "VERSION",
    "DiskStats",
    "DiskStore",
    "model_fingerprint",
]
