"""The router's view of the disk tier: which replica wrote each block to its node's disk, and
which replicas share a node (and so read each other's disk blocks).

A replica publishes ``stored`` / ``removed`` events of tier ``disk`` for the blocks of its own
slab (``replicas.kv.disk``), and a snapshot's disk hashes; a restarted replica announces
the blocks it took back from its slab as its first events. Any replica on the writer's node can
read a block, so a prompt's disk run on replica r is the run of blocks, right after its NPU/host
match, that some replica on r's node wrote::

    holders[block_hash]  bit w set: replica w wrote the block to its node's disk
    node_mask[r]         bit w set: replica w shares r's node (r itself included)
    credited to r        holders[block_hash] & node_mask[r] != 0

A replica that dies, or is retired by a scale-in, keeps its bits (its files stay on the node's
disk and stay readable by the node's other replicas); one that rejoins starts empty and
announces again. A replica added by a scale-out grows the masks by one bit (``add_replica``).
Only the global (``full``) cache type is indexed: a hybrid model's disk blocks are not credited
(its sliding window would need them too).
"""

from collections.abc import Sequence

from replicas.kv.events import FULL, KVEventBatch, KVEventKind, KVSnapshot, Tier
from replicas.kv.hashing import BlockHash


class NodeDiskIndex:
    """Disk blocks per writing replica, read per node. Not thread-safe (the router's)."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self._holders: dict[BlockHash, int] = {}
        self._num_blocks = [0] * num_replicas
        self._node_mask = [1 << r for r in range(num_replicas)]  # until set_nodes says
        self._node_ids = [f"unknown-{r}" for r in range(num_replicas)]

    def __len__(self) -> int:
        return len(self._holders)

    def num_blocks(self, replica: int) -> int:
        """Blocks ``replica`` wrote to its node's disk."""
        return self._num_blocks[replica]

    def add_replica(self, node_id: str | None = None) -> int:
        """Grow the index by one replica that wrote nothing, on node ``node_id`` (None: a node
        of its own until ``set_nodes``); its index (mutates)."""
        replica = self.num_replicas
        self.num_replicas += 1
        self._num_blocks.append(0)
        self._node_mask.append(1 << replica)
        self._node_ids.append(node_id if node_id is not None else f"unknown-{replica}")
        self.set_nodes(self._node_ids)
        return replica

    def set_nodes(self, node_ids: Sequence[str]) -> None:
        """Which node each replica runs on (replicas with equal ids share a disk)."""
        if len(node_ids) != self.num_replicas:
            raise ValueError(f"{len(node_ids)} node ids for {self.num_replicas} replicas")
        self._node_ids = list(node_ids)
        for replica, node in enumerate(node_ids):
            self._node_mask[replica] = sum(
                1 << w for w, other in enumerate(node_ids) if other == node
            )

    def apply(self, batch: KVEventBatch) -> None:
        """Apply the disk events of ``batch`` (mutates; other tiers and cache types are not
        this index's)."""
        bit = 1 << batch.replica_index
        disk, stored, removed = Tier.DISK, KVEventKind.STORED, KVEventKind.REMOVED
        for kind, tier, block_hash, cache_type in batch.events:
            if tier != disk or cache_type != FULL:
                continue
            if kind == stored:
                self._add(block_hash, bit, batch.replica_index)
            elif kind == removed:
                self._remove(block_hash, bit, batch.replica_index)
            else:
                raise ValueError(f"unknown KV event kind {kind!r}")

    def load_snapshot(self, snapshot: KVSnapshot) -> None:
        """Replace the snapshot's replica's disk blocks by the snapshot's (mutates)."""
        replica = snapshot.replica_index
        self.clear_replica(replica)
        for block_hash in snapshot.hashes(Tier.DISK):
            self._add(block_hash, 1 << replica, replica)

    def clear_replica(self, replica: int) -> None:
        bit = 1 << replica
        for block_hash in [h for h, held in self._holders.items() if held & bit]:
            self._remove(block_hash, bit, replica)

    def extend(self, block_hashes: Sequence[BlockHash], start: int, replica: int) -> int:
        """Blocks from ``start`` on, in a row, that some replica on ``replica``'s node wrote."""
        holders, mask = self._holders, self._node_mask[replica]
        end = start
        while end < len(block_hashes) and holders.get(block_hashes[end], 0) & mask:
            end += 1
        return end - start

    def check_integrity(self) -> None:
        counts = [0] * self.num_replicas
        for block_hash, held in self._holders.items():
            assert held, f"disk index entry {block_hash.hex()} held by nobody"
            for replica in range(self.num_replicas):
                counts[replica] += bool(held >> replica & 1)
        assert counts == self._num_blocks, f"disk block counts {self._num_blocks} != {counts}"

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
