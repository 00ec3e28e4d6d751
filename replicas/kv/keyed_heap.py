"""Block ids ordered by a key, smallest first, with removal and re-keying by id.

A binary heap of ``(key, block id)`` entries beside a map from each id to its current key. An id
removed or given a new key leaves its old entry in the heap; that entry is stale (its key no
longer matches the map) and is skipped when it reaches the top. The heap is rebuilt from the map
when stale entries outnumber live ones. ``FreeBlockQueue`` keeps its decaying retained blocks,
and blocks whose retention ended, in two of these.
"""

import heapq
from collections.abc import Iterator


class KeyedHeap:
    """Block ids by key, smallest first (ties: the smaller id). Not thread-safe."""

    __slots__ = ("_heap", "_keys")

    def __init__(self) -> None:
        self._keys: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []  # stale entries skipped

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._keys

    def __iter__(self) -> Iterator[int]:
        """The ids, smallest key first."""
        return (block_id for _, block_id in self.items())

    def items(self) -> list[tuple[float, int]]:
        """``(key, id)`` of every id, smallest key first."""
        return sorted((key, block_id) for block_id, key in self._keys.items())

    def key(self, block_id: int) -> float:
        return self._keys[block_id]

    def first(self) -> tuple[float, int] | None:
        """``(key, id)`` of the smallest key (None when empty); drops stale entries on the way."""
        heap = self._heap
        while heap and self._keys.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def add(self, block_id: int, key: float) -> None:
        """Put ``block_id`` in with ``key`` (replacing the key it had)."""
        self._keys[block_id] = key
        heapq.heappush(self._heap, (key, block_id))
        if len(self._heap) > 2 * len(self._keys) + 16:
            self._heap = [(k, b) for b, k in self._keys.items()]
            heapq.heapify(self._heap)

    def pop(self, block_id: int, default: float | None = None) -> float | None:
        """Take ``block_id`` out; its key (``default`` when it is not in)."""
        return self._keys.pop(block_id, default)

    def take(self) -> int:
        """Take out the id of the smallest key (the heap must not be empty)."""
        entry = self.first()
        if entry is None:
            raise IndexError("take from an empty KeyedHeap")
        del self._keys[entry[1]]
        heapq.heappop(self._heap)
        return entry[1]

    def clear(self) -> None:
        self._keys.clear()
        self._heap.clear()
