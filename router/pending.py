"""Prompts routed but not yet computed: what the prefix index cannot know yet.

A replica publishes a block's KV event once the block is computed, so between routing a request
and the replica's report of its first token (the report that carries its prompt blocks' events)
the index does not know that the prompt is about to be cached there. Without this record, a
burst of requests sharing a prefix that arrives within one prefill scatters over the replicas,
each computing the prefix again, and the copies then crowd each replica's cache.

Timeline of one request on the router::

    route ──────────────── first token reported ─────────── finished / aborted
      │   pending: counts as NPU-cached  │  index: from the replica's KV events
      └── add(request)                   └── remove(request) (release removes it too)

Block hashes chain, so a prompt shares blocks with a pending prompt only if both start with the
same block, and then exactly a leading run. Pending prompts are grouped by their first block
hash; the run a prompt shares with each pending prompt of its group is found by bisecting on
list-slice equality (C-level comparisons, no Python code per block), so looking up a prompt that
shares no first block with any pending prompt costs one dict look-up.
"""

from collections.abc import Sequence
from typing import NamedTuple

from replicas.hashing import BlockHash


class _Pending(NamedTuple):
    replica: int
    block_hashes: list[BlockHash]


class PendingPrompts:
    """The prompt block hashes of routed requests whose first token is not yet reported.

    Invariants (``check_integrity``): every request appears in exactly one group, the group of
    its first block hash; no group is empty; requests with no full block are not kept.
    """

    def __init__(self) -> None:
        self._groups: dict[BlockHash, dict[str, _Pending]] = {}  # first hash -> request -> ...
        self._first_hash: dict[str, BlockHash] = {}  # request -> its group's key

    def __len__(self) -> int:
        """Number of pending requests."""
        return len(self._first_hash)

    def add(self, request_id: str, replica: int, block_hashes: Sequence[BlockHash]) -> None:
        """Record a routed request's prompt blocks on ``replica`` (mutates). Raises ValueError
        if the request is already pending."""
        if request_id in self._first_hash:
            raise ValueError(f"request {request_id!r} is already pending")
        if not block_hashes:
            return
        first = block_hashes[0]
        self._groups.setdefault(first, {})[request_id] = _Pending(replica, list(block_hashes))
        self._first_hash[request_id] = first

    def remove(self, request_id: str) -> None:
        """Forget the request (mutates); a no-op if it is not pending."""
        first = self._first_hash.pop(request_id, None)
        if first is None:
            return
        group = self._groups[first]
        del group[request_id]
        if not group:
            del self._groups[first]

    def clear_replica(self, replica: int) -> None:
        """Forget every request pending on ``replica`` (mutates)."""
        doomed = [r for g in self._groups.values() for r, p in g.items() if p.replica == replica]
        for request_id in doomed:
            self.remove(request_id)

    def runs(self, block_hashes: Sequence[BlockHash]) -> dict[int, int]:
        """For each replica with a pending prompt sharing leading blocks with ``block_hashes``,
        the longest such shared run, in blocks (read-only)."""
        if not block_hashes:
            return {}
        group = self._groups.get(block_hashes[0])
        if not group:
            return {}
        if not isinstance(block_hashes, list):  # slices must be lists to compare equal
            block_hashes = list(block_hashes)
        runs: dict[int, int] = {}
        for pending in group.values():
            run = _common_run(block_hashes, pending.block_hashes)
            if run > runs.get(pending.replica, 0):
                runs[pending.replica] = run
        return runs

    def check_integrity(self) -> None:
        """Raise AssertionError unless groups and requests agree."""
        seen = 0
        for first, group in self._groups.items():
            assert group, f"empty pending group {first.hex()}"
            for request_id, pending in group.items():
                assert pending.block_hashes[0] == first, f"{request_id!r} in the wrong group"
                assert self._first_hash.get(request_id) == first, f"{request_id!r} not indexed"
            seen += len(group)
        assert seen == len(self._first_hash), "pending requests and groups disagree"


def _common_run(a: list[BlockHash], b: list[BlockHash]) -> int:
    """Length of the longest common leading run of ``a`` and ``b``."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; a[:high + 1] != b[:high + 1]
    if a[:high] == b[:high]:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low
