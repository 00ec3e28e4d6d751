"""What the router believes each replica has cached, and how long a prompt's cached prefix is
on each: the prefix index (NPU and host blocks), a hybrid model's sliding-block index, the node
disk index, and prompts routed but not computed yet. Plain class; the ``Router`` owns one."""

from collections.abc import Sequence

from replicas.kv.events import (
    SLIDING,
    KVEventBatch,
    KVSnapshot,
    Tier,
    per_tier,
    safe_prefix_length,
)
from replicas.kv.hashing import BlockHash
from router.disk_index import NodeDiskIndex
from router.pending import PendingPrompts
from router.prefix_index import IndexMatch, PrefixIndex


class ReplicaCaches:
    """The indexes that follow the replicas' KV events and the prompts pending on them.

    A prompt routed to a replica counts as NPU-cached there until the replica reports the
    request's first token (``router.pending``: its blocks' events are not out yet).

    For a hybrid model (``sliding_window`` set) a second index follows the replicas' sliding
    blocks, and a replica's cached prefix counts only as far as the replica itself would reuse
    it: the longest run whose sliding window is cached too (``safe_prefix_length``, the rule
    of the replica's ``KVCacheManager.match_prefix``).

    A replica's disk blocks are its node's: they continue the run of any replica on that node,
    and stay credited when the replica dies. Not thread-safe: the router's caller serialises
    calls.
    """

    def __init__(self, num_replicas: int, block_size: int, sliding_window: int | None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._index = PrefixIndex(num_replicas)
        self._indexes = [self._index]
        self._sliding_index: PrefixIndex | None = None
        if sliding_window is not None:
            self._sliding_index = PrefixIndex(num_replicas, SLIDING)
            self._indexes.append(self._sliding_index)
        self._disk = NodeDiskIndex(num_replicas)
        self._pending = PendingPrompts()

    # ---- queries (no mutation) ---------------------------------------------------------------
    def __len__(self) -> int:
        """Hashes in the prefix index."""
        return len(self._index)

    @property
    def num_pending(self) -> int:
        """Prompts routed and not computed yet."""
        return len(self._pending)

    def num_blocks_by_tier(self, replica: int) -> tuple[int, ...]:
        """The replica's indexed blocks per tier (``per_tier``; disk: its node's)."""
        return per_tier(
            {
                Tier.NPU: self._index.num_npu_blocks(replica),
                Tier.HOST: self._index.num_host_blocks(replica),
                Tier.DISK: self._disk.num_blocks(replica),
            }
        )

    def match(self, block_hashes: Sequence[BlockHash], live: Sequence[int]) -> list[IndexMatch]:
        """Each live replica's cached prefix: the longer of its indexed run and the run it
        shares with a prompt routed there and not yet computed (counted as NPU blocks)."""
        matches = self._index.match(block_hashes, live)
        if self._sliding_index is not None:
            matches = [self._safe(block_hashes, r, m) for r, m in enumerate(matches)]
        elif len(self._disk):  # a node's disk blocks continue any of its replicas' runs
            for replica in live:
                match = matches[replica]
                num_disk = self._disk.extend(block_hashes, match.num_blocks, replica)
                if num_disk:
                    matches[replica] = match.with_blocks_in(Tier.DISK, num_disk)
        for replica, num_blocks in self._pending.runs(block_hashes).items():
            if num_blocks > matches[replica].num_blocks:
                matches[replica] = IndexMatch.of({Tier.NPU: num_blocks})
        return matches

    def _safe(
        self, block_hashes: Sequence[BlockHash], replica: int, match: IndexMatch
    ) -> IndexMatch:
        """``match`` cut to the replica's safe prefix of a hybrid model's prompt."""
        if not match.num_blocks:
            return match
        present = self._sliding_index.holds(block_hashes[: match.num_blocks], replica)
        length = safe_prefix_length(present, match.num_blocks, self.block_size, self.sliding_window)
        if length == match.num_blocks:
            return match
        return self._index.count_tiers(block_hashes[:length], replica)

    # ---- mutation ----------------------------------------------------------------------------
    def add_pending(self, request_id: str, replica: int, block_hashes: Sequence[BlockHash]) -> None:
        """Count the prompt as cached on ``replica`` until ``remove_pending``."""
        self._pending.add(request_id, replica, block_hashes)

    def remove_pending(self, request_id: str) -> None:
        """The request's prompt is computed (its events are out) or dropped; idempotent."""
        self._pending.remove(request_id)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply a batch of events the router has not seen yet, to every index."""
        for index in self._indexes:
            index.apply(batch)
        self._disk.apply(batch)

    def load_snapshot(self, snapshot: KVSnapshot) -> None:
        """Replace the replica's entries in every index by ``snapshot``'s."""
        for index in self._indexes:
            index.load_snapshot(snapshot)
        self._disk.load_snapshot(snapshot)

    def load_disk_snapshot(self, snapshot: KVSnapshot) -> None:
        """Credit ``snapshot``'s disk blocks to the replica's node (a retiring replica's last
        snapshot: its slab stays readable)."""
        self._disk.load_snapshot(snapshot)

    def clear_replica(self, replica: int, *, with_disk: bool) -> None:
        """Drop the replica's indexed blocks and pending prompts; ``with_disk``, its announced
        disk blocks too (a fresh process announces them again)."""
        for index in self._indexes:
            index.clear_replica(replica)
        if with_disk:
            self._disk.clear_replica(replica)
        self._pending.clear_replica(replica)

    def add_replica(self, node_id: str | None = None) -> None:
        """Grow every index by one replica on node ``node_id``."""
        for index in self._indexes:
            index.add_replica()
        self._disk.add_replica(node_id)

    def set_nodes(self, node_ids: Sequence[str]) -> None:
        """Which node each replica runs on: replicas of one node share its disk tier."""
        self._disk.set_nodes(node_ids)

    # ---- accounting --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every index and the pending prompts are consistent."""
        for index in self._indexes:
            index.check_integrity()
        self._disk.check_integrity()
        self._pending.check_integrity()
