"""The other slabs of a store's directory (other replicas', or a finished process's), read-only:
which blocks they hold and where, learned by re-reading their index files when one changed (by
mtime and size), at most every ``PEER_REFRESH_S``. What a block was found as (slab, slot,
generation) is read back only if its record still has that generation, so a stale view costs a
miss, never a wrong block.
"""

import os
import time

from replicas.kv.disk.record import Heat, Location, parse_index, slab_number, slab_path
from replicas.kv.hashing import BlockHash

PEER_REFRESH_S = 0.25
"""Least seconds between two re-reads of the other slabs' index files."""


class PeerSlabs:
    """The blocks of every slab in ``directory`` but ``own_slab``, with their hit weights; the
    first slab (by number) holding a key wins. The engine thread alone calls it."""

    def __init__(self, directory: str, own_slab: int) -> None:
        self.directory = directory
        self.own_slab = own_slab
        self._locations: dict[BlockHash, Location] = {}
        self._heat: dict[BlockHash, Heat] = {}
        self._files: dict[int, tuple[int, int]] = {}  # slab -> (mtime_ns, size) read
        self._checked = 0.0  # time.monotonic() of the last look at the directory
        self._bad: set[Location] = set()  # blocks that failed a read

    def locate(self, key: BlockHash) -> Location | None:
        """Where another slab holds ``key`` (after a refresh if due); None if none does, or
        its block there failed a read."""
        self.refresh()
        location = self._locations.get(key)
        return None if location is None or location in self._bad else location

    def heat_of(self, key: BlockHash) -> Heat | None:
        """The hit weight another slab's record of ``key`` carries, as last read."""
        return self._heat.get(key)

    def held_keys(self) -> list[BlockHash]:
        """Every key another slab holds, by a fresh look at the directory, failed ones left
        out."""
        self.refresh(force=True)
        return [k for k, loc in self._locations.items() if loc not in self._bad]

    def mark_bad(self, key: BlockHash) -> None:
        """Never offer ``key`` at its current location again (a read of it failed)."""
        location = self._locations.get(key)
        if location is not None:
            self._bad.add(location)

    def refresh(self, force: bool = False) -> None:
        """Re-read the index files if one appeared, changed or went away since they were read;
        a look at the directory at most every ``PEER_REFRESH_S`` unless ``force``d."""
        now = time.monotonic()
        if not force and now - self._checked < PEER_REFRESH_S:
            return
        self._checked = now
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        if self._files_changed(names):
            self._read()

    def _files_changed(self, names: list[str]) -> bool:
        """Note each other slab's index file (mtime, size); whether any differs from the last
        read, or went away."""
        seen = set()
        changed = False
        for name in names:
            slab = slab_number(name)
            if slab is None or slab == self.own_slab:
                continue
            seen.add(slab)
            try:
                stat = os.stat(os.path.join(self.directory, name))
            except OSError:
                continue
            if self._files.get(slab) != (stat.st_mtime_ns, stat.st_size):
                self._files[slab] = (stat.st_mtime_ns, stat.st_size)
                changed = True
        for slab in set(self._files) - seen:
            del self._files[slab]
            changed = True
        return changed

    def _read(self) -> None:
        """Read every noted index file anew: a key's first slab by number wins."""
        self._heat = {}
        locations: dict[BlockHash, Location] = {}
        for slab in sorted(self._files):
            try:
                with open(slab_path(self.directory, slab, "idx"), "rb") as file:
                    data = file.read()
            except OSError:
                continue
            for slot, record in enumerate(parse_index(data)):
                if record is not None and record.key not in locations:
                    locations[record.key] = Location(slab, slot, record.generation)
                    self._heat[record.key] = record.heat
        self._locations = locations
