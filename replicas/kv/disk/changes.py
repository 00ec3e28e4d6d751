"""The changes of a store's own blocks that the replica announces (KV events): which were
stored and removed, in order, once someone asked to track them."""

from replicas.kv.hashing import BlockHash


class ChangeLog:
    """(stored?, key) per change of the own blocks, recorded only once ``track`` was called (a
    replica without events pays nothing)."""

    def __init__(self) -> None:
        self._changes: list[tuple[bool, BlockHash]] | None = None

    @property
    def tracking(self) -> bool:
        return self._changes is not None

    def track(self, held: list[BlockHash]) -> None:
        """Record changes from now on, the ``held`` keys counted as stored now; no-op when
        tracking already."""
        if self._changes is None:
            self._changes = [(True, key) for key in held]

    def note(self, stored: bool, key: BlockHash) -> None:
        """One own block stored (True) or removed (False), if tracking."""
        if self._changes is not None:
            self._changes.append((stored, key))

    def drain(self) -> list[tuple[bool, BlockHash]]:
        """The changes since the last call, in order (none when not tracking)."""
        if self._changes is None:
            return []
        changes, self._changes = self._changes, []
        return changes
