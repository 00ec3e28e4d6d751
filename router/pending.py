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
same block, and then exactly a leading run, whose length one comparison per probe can bisect
(equal hashes at block k mean equal prefixes up to k). Pending prompts are grouped by their first
block hash: a prompt sharing no first block with a pending prompt costs one dict look-up;
otherwise each of the group's newest prompts costs one comparison, plus a bisection when it
shares more than the best run found so far on its replica.
"""

from collections.abc import Sequence
from itertools import islice
from typing import NamedTuple

from replicas.kv.hashing import BlockHash

MAX_COMPARED = 64
"""Pending prompts compared per look-up, newest first: when a hot prefix has thousands of requests
in flight, a decision still costs at most this many comparisons (older ones have mostly been
computed in part, and their blocks' events are in the index)."""


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
        the longest such shared run, in blocks, among the ``MAX_COMPARED`` newest pending
        prompts that share its first block (read-only)."""
        if not block_hashes:
            return {}
        group = self._groups.get(block_hashes[0])
        if not group:
            return {}
        runs: dict[int, int] = {}
        for pending in islice(reversed(group.values()), MAX_COMPARED):
            best = runs.get(pending.replica, 0)
            other = pending.block_hashes
            limit = min(len(block_hashes), len(other))
            if best < limit and block_hashes[best] == other[best]:  # shares more than best
                runs[pending.replica] = _common_run(block_hashes, other, best + 1, limit)
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


def _common_run(a: Sequence[BlockHash], b: Sequence[BlockHash], low: int, high: int) -> int:
    """Length of the common leading run of two chains known to share ``low`` blocks and to share
    at most ``high``. Chained hashes make one comparison per probe enough: ``a[k] == b[k]``
    means the whole prefix up to block k is equal."""
    while low < high:
        middle = (low + high + 1) // 2
        if a[middle - 1] == b[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low
