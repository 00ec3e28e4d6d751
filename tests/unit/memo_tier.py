"""A tier behind host defined outside Strata's sources, for ``test_tier_plugin``: KV blocks kept
in a dict in this process (a stand-in for a remote memory store), least recently stored first
out, read on a thread of their own. This file and its registry entry are the whole tier."""

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from replicas.kv.events import TierTraits
from replicas.kv.records import TierUsage
from replicas.kv.tiers import BackingOptions, BackingStore, TierContext, TierPlugin


class MemoStats(NamedTuple):
    blocks_written: int
    blocks_read: int


class MemoStore:
    """One cache type's blocks: a bounded LRU of (hash -> tensor), changes announced."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="memo-tier")
        self._changes: list[tuple[bool, bytes]] | None = None
        self.num_written = self.num_read = 0

    def store(self, block_hash, block, retained_until=0.0, weight=0.0) -> None:
        with self._lock:
            while len(self._blocks) >= self.num_blocks:
                self._drop(next(iter(self._blocks)))
            self._blocks[block_hash] = block
            self.num_written += 1
        self._note(True, block_hash)

    def load_many(self, block_hashes, outs) -> "Future[list[bool]]":
        def read() -> list[bool]:
            with self._lock:
                found = [self._blocks.get(h) for h in block_hashes]
            for out, block in zip(outs, found):
                if block is not None:
                    out.copy_(block)
            self.num_read += sum(b is not None for b in found)
            return [b is not None for b in found]

        return self._io.submit(read)

    def contains(self, block_hash) -> bool:
        return block_hash in self._blocks

    def discard(self, block_hash) -> None:
        with self._lock:
            self._drop(block_hash)

    def _drop(self, block_hash) -> None:
        if self._blocks.pop(block_hash, None) is not None:
            self._note(False, block_hash)

    def read_seconds_per_block(self) -> float:
        return 1e-6

    def retain(self, block_hash, until) -> bool:
        return False

    def expire(self) -> None:
        pass

    def usage(self) -> TierUsage:
        return TierUsage(self.num_blocks, 0, len(self._blocks))

    def cached_hashes(self) -> list[bytes]:
        return list(self._blocks)

    def reset(self) -> list[bytes]:
        with self._lock:
            for block_hash in list(self._blocks):
                self._drop(block_hash)
        return []  # announced through drain_changes

    def track_changes(self) -> None:
        if self._changes is None:
            self._changes = [(True, h) for h in self._blocks]

    def drain_changes(self) -> list[tuple[bool, bytes]]:
        changes, self._changes = self._changes or [], [] if self._changes is not None else None
        return changes

    def _note(self, stored: bool, block_hash: bytes) -> None:
        if self._changes is not None:
            self._changes.append((stored, block_hash))

    def flush(self, timeout=None) -> bool:
        return True

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def stats(self) -> MemoStats:
        return MemoStats(self.num_written, self.num_read)


def open_stores(context: TierContext, options: BackingOptions) -> dict[str, BackingStore]:
    return {cache_type: MemoStore(n) for cache_type, n in context.num_blocks.items()}


PLUGIN = TierPlugin(TierTraits("memo", hit_weight=0.6), BackingOptions, open_stores)
