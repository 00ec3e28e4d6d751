"""The router's view of one backing tier (a tier behind host, such as disk): which replica wrote
each block to it, and which replicas read each other's blocks.

A replica publishes ``stored`` / ``removed`` events of the tier for the blocks it holds there,
and a snapshot's hashes of the tier; a restarted replica announces the blocks it took back as
its first events. When the tier's traits say ``shared_by_node`` (disk: the replicas of one node
read each other's slabs) any replica on the writer's node can read a block; otherwise only the
writer can. A prompt's run in the tier on replica r is the run of blocks, right after its
NPU/host match, that a replica whose blocks r reads wrote::

    holders[block_hash]  bit w set: replica w wrote the block to the tier
    read_mask[r]         bit w set: r reads w's blocks (r itself; its node's replicas if shared)
    credited to r        holders[block_hash] & read_mask[r] != 0

A replica that dies, or is retired by a scale-in, keeps its bits (a node-shared tier's blocks
stay readable by the node's other replicas); one that rejoins starts empty and announces again.
A replica added by a scale-out grows the masks by one bit (``add_replica``). Only the global
(``full``) cache type is indexed: a hybrid model's backing blocks are not credited (its sliding
window would need them too).
"""

from collections.abc import Sequence

from replicas.kv.events import FULL, KVEventBatch, KVEventKind, KVSnapshot, Tier
from replicas.kv.hashing import BlockHash


class BackingIndex:
    """One backing tier's blocks per writing replica, read per node (a node-shared tier) or by
    the writer alone. Not thread-safe (the router's)."""

    def __init__(self, tier: Tier | str, num_replicas: int) -> None:
        self.tier = Tier(tier)
        self.shared_by_node = self.tier.traits.shared_by_node
        self.num_replicas = num_replicas
        self._holders: dict[BlockHash, int] = {}
        self._num_blocks = [0] * num_replicas
        self._read_mask = [1 << r for r in range(num_replicas)]  # until set_nodes says
        self._node_ids = [f"unknown-{r}" for r in range(num_replicas)]

    def __len__(self) -> int:
        return len(self._holders)

    def num_blocks(self, replica: int) -> int:
        """Blocks ``replica`` wrote to the tier."""
        return self._num_blocks[replica]

    def add_replica(self, node_id: str | None = None) -> int:
        """Grow the index by one replica that wrote nothing, on node ``node_id`` (None: a node
        of its own until ``set_nodes``); its index (mutates)."""
        replica = self.num_replicas
        self.num_replicas += 1
        self._num_blocks.append(0)
        self._read_mask.append(1 << replica)
        self._node_ids.append(node_id if node_id is not None else f"unknown-{replica}")
        self.set_nodes(self._node_ids)
        return replica

    def set_nodes(self, node_ids: Sequence[str]) -> None:
        """Which node each replica runs on (replicas with equal ids share a node-shared tier)."""
        if len(node_ids) != self.num_replicas:
            raise ValueError(f"{len(node_ids)} node ids for {self.num_replicas} replicas")
        self._node_ids = list(node_ids)
        if not self.shared_by_node:
            return  # each replica reads its own blocks only
        for replica, node in enumerate(node_ids):
            self._read_mask[replica] = sum(
                1 << w for w, other in enumerate(node_ids) if other == node
            )

    def apply(self, batch: KVEventBatch) -> None:
        """Apply the events of ``batch`` in this index's tier (mutates; other tiers and cache
        types are not this index's)."""
        bit = 1 << batch.replica_index
        own, stored, removed = self.tier, KVEventKind.STORED, KVEventKind.REMOVED
        for kind, tier, block_hash, cache_type in batch.events:
            if tier != own or cache_type != FULL:
                continue
            if kind == stored:
                self._add(block_hash, bit, batch.replica_index)
            elif kind == removed:
                self._remove(block_hash, bit, batch.replica_index)
            else:
                raise ValueError(f"unknown KV event kind {kind!r}")

    def load_snapshot(self, snapshot: KVSnapshot) -> None:
        """Replace the snapshot's replica's blocks in the tier by the snapshot's (mutates)."""
        replica = snapshot.replica_index
        self.clear_replica(replica)
        for block_hash in snapshot.hashes(self.tier):
            self._add(block_hash, 1 << replica, replica)

    def clear_replica(self, replica: int) -> None:
        bit = 1 << replica
        for block_hash in [h for h, held in self._holders.items() if held & bit]:
            self._remove(block_hash, bit, replica)

    def holds(self, block_hash: BlockHash, replica: int) -> bool:
        """Whether ``replica`` reads the block from the tier (some replica it reads wrote it)."""
        return bool(self._holders.get(block_hash, 0) & self._read_mask[replica])

    def extend(self, block_hashes: Sequence[BlockHash], start: int, replica: int) -> int:
        """Blocks from ``start`` on, in a row, that ``replica`` reads from the tier."""
        holders, mask = self._holders, self._read_mask[replica]
        end = start
        while end < len(block_hashes) and holders.get(block_hashes[end], 0) & mask:
            end += 1
        return end - start

    def check_integrity(self) -> None:
        counts = [0] * self.num_replicas
        for block_hash, held in self._holders.items():
            assert held, f"{self.tier} index entry {block_hash.hex()} held by nobody"
            for replica in range(self.num_replicas):
                counts[replica] += bool(held >> replica & 1)
        assert counts == self._num_blocks, (
            f"{self.tier} block counts {self._num_blocks} != {counts}"
        )

    def _add(self, block_hash: BlockHash, bit: int, replica: int) -> None:
        held = self._holders.get(block_hash, 0)
        if not held & bit:
            self._holders[block_hash] = held | bit
            self._num_blocks[replica] += 1

    def _remove(self, block_hash: BlockHash, bit: int, replica: int) -> None:
        held = self._holders.get(block_hash, 0)
        if held & bit:
            held &= ~bit
            if held:
                self._holders[block_hash] = held
            else:
                del self._holders[block_hash]
            self._num_blocks[replica] -= 1
