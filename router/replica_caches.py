"""What the router believes each replica has cached, and how long a prompt's cached prefix is
on each: the prefix index (NPU and host blocks), a hybrid model's sliding-block index, one index
per backing tier (disk, and any tier registered behind host), and prompts routed but not
computed yet. Plain class; the ``Router`` owns one."""

from collections.abc import Sequence
from itertools import islice

from replicas.kv.events import (
    SLIDING,
    KVEventBatch,
    KVSnapshot,
    Tier,
    backing_tiers,
    per_tier,
    safe_prefix_length,
)
from replicas.kv.hashing import BlockHash
from router.backing_index import BackingIndex
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

    Blocks of the backing tiers continue a replica's NPU/host run, each credited to the nearest
    backing tier that holds it for the replica. A node-shared tier's blocks (disk) continue the
    run of any replica on the writer's node, and stay credited when the writer dies; a tier
    registered after this object was built gets its index on the next call that needs it. Not
    thread-safe: the router's caller serialises calls.
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
        self._node_ids = [f"unknown-{r}" for r in range(num_replicas)]
        self._backing: dict[Tier, BackingIndex] = {}
        self._num_tiers = 0
        self._backing_indexes()
        self._pending = PendingPrompts()

    def _backing_indexes(self) -> dict[Tier, BackingIndex]:
        """One index per backing tier, nearest first; a tier registered since the last call
        gets an empty one (its replicas announce its blocks with their events)."""
        if self._num_tiers != len(Tier):
            self._num_tiers = len(Tier)
            indexes = {}
            for tier in backing_tiers():
                index = self._backing.get(tier)
                if index is None:
                    index = BackingIndex(tier, self._index.num_replicas)
                    index.set_nodes(self._node_ids)
                indexes[tier] = index
            self._backing = indexes
        return self._backing

    # ---- queries (no mutation) ---------------------------------------------------------------
    def __len__(self) -> int:
        """Hashes in the prefix index."""
        return len(self._index)

    @property
    def num_pending(self) -> int:
        """Prompts routed and not computed yet."""
        return len(self._pending)

    def num_blocks_by_tier(self, replica: int) -> tuple[int, ...]:
        """The replica's indexed blocks per tier (``per_tier``; a backing tier's: the blocks
        the replica wrote there)."""
        counts = {
            Tier.NPU: self._index.num_npu_blocks(replica),
            Tier.HOST: self._index.num_host_blocks(replica),
        }
        for tier, index in self._backing_indexes().items():
            counts[tier] = index.num_blocks(replica)
        return per_tier(counts)

    def match(self, block_hashes: Sequence[BlockHash], live: Sequence[int]) -> list[IndexMatch]:
        """Each live replica's cached prefix: the longer of its indexed run and the run it
        shares with a prompt routed there and not yet computed (counted as NPU blocks)."""
        matches = self._index.match(block_hashes, live)
        if self._sliding_index is not None:
            matches = [self._safe(block_hashes, r, m) for r, m in enumerate(matches)]
        elif backing := [index for index in self._backing_indexes().values() if len(index)]:
            only = backing[0] if len(backing) == 1 else None  # the common case: disk alone
            for replica in live:  # backing blocks continue the NPU/host run of their readers
                match = matches[replica]
                if only is not None:
                    num_blocks = only.extend(block_hashes, match.num_blocks, replica)
                    if num_blocks:
                        matches[replica] = match.with_blocks({only.tier: num_blocks})
                elif run := _backing_run(backing, block_hashes, match.num_blocks, replica):
                    matches[replica] = match.with_blocks(run)
        for replica, num_blocks in self._pending.runs(block_hashes).items():
            if num_blocks > matches[replica].num_blocks:
                matches[replica] = IndexMatch.of({Tier.NPU: num_blocks})
        return matches

    def held(self, block_hashes: Sequence[BlockHash], live: Sequence[int]) -> list[int]:
        """Each replica's leading run of the prompt's blocks that it holds computed in its NPU
        or host tier (an index match without pending prompts or backing tiers: the blocks it
        can hand to a peer); all 0 for a hybrid model, whose sliding blocks are not indexed
        per block for this."""
        if self._sliding_index is not None:
            return [0] * len(self._index.match((), ()))
        matches = self._index.match(block_hashes, live)
        return [m.num_blocks_in(Tier.NPU) + m.num_blocks_in(Tier.HOST) for m in matches]

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
        for index in self._backing_indexes().values():
            index.apply(batch)

    def load_snapshot(self, snapshot: KVSnapshot) -> None:
        """Replace the replica's entries in every index by ``snapshot``'s."""
        for index in self._indexes:
            index.load_snapshot(snapshot)
        for index in self._backing_indexes().values():
            index.load_snapshot(snapshot)

    def load_node_snapshot(self, snapshot: KVSnapshot) -> None:
        """Credit ``snapshot``'s blocks of the node-shared backing tiers (disk) to the
        replica's node (a retiring replica's last snapshot: its slab stays readable)."""
        for index in self._backing_indexes().values():
            if index.shared_by_node:
                index.load_snapshot(snapshot)

    def clear_replica(self, replica: int, *, with_node_tiers: bool) -> None:
        """Drop the replica's indexed blocks (its own backing tiers' included: nobody else
        reads them) and pending prompts; ``with_node_tiers``, its announced blocks of the
        node-shared tiers too (a fresh process announces them again)."""
        for index in self._indexes:
            index.clear_replica(replica)
        for index in self._backing_indexes().values():
            if with_node_tiers or not index.shared_by_node:
                index.clear_replica(replica)
        self._pending.clear_replica(replica)

    def add_replica(self, node_id: str | None = None) -> None:
        """Grow every index by one replica on node ``node_id``."""
        backing = self._backing_indexes()  # first: a new tier's index sizes to the others
        replica = self._index.num_replicas
        for index in self._indexes:
            index.add_replica()
        for index in backing.values():
            index.add_replica(node_id)
        self._node_ids.append(node_id if node_id is not None else f"unknown-{replica}")

    def set_nodes(self, node_ids: Sequence[str]) -> None:
        """Which node each replica runs on: replicas of one node share its node-shared tiers."""
        for index in self._backing_indexes().values():
            index.set_nodes(node_ids)
        self._node_ids = list(node_ids)

    # ---- accounting --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every index and the pending prompts are consistent."""
        for index in self._indexes:
            index.check_integrity()
        for index in self._backing_indexes().values():
            index.check_integrity()
        self._pending.check_integrity()


def _backing_run(
    indexes: Sequence[BackingIndex], block_hashes: Sequence[BlockHash], start: int, replica: int
) -> dict[Tier, int]:
    """The blocks from ``start`` on, in a row, that some of ``indexes`` (nearest first) holds
    for ``replica``, counted per tier: each block in the nearest tier holding it."""
    run: dict[Tier, int] = {}
    for block_hash in islice(block_hashes, start, None):
        tier = next((index.tier for index in indexes if index.holds(block_hash, replica)), None)
        if tier is None:
            break
        run[tier] = run.get(tier, 0) + 1
    return run
