"""The approximate prefix trees peers keep from their own routing decisions (no KV events).

SGLang's router and Ray Serve keep a multi-tenant radix tree of request *text*; llm-d's
approximate scorer keeps an LRU index of prompt *block hashes* per server. Here all three are one
structure at block granularity: since block hashes chain, a prefix of blocks is a path in a
radix tree, and a tenant's subtree is its set of hashes. At the trace's granularity (whole hash
ids, one or more blocks each) a character tree would match the same prefix up to the trailing
partial block, which no KV cache can reuse anyway.

Per replica an LRU order of its hashes. ``insert`` touches a prompt's blocks deepest first, so a
parent is always more recent than its children and eviction takes leaves first (as SGLang's
leaf eviction and Ray's LRU list do); a prefix never loses an inner block to eviction.
"""

import functools
import importlib
import warnings
from collections import OrderedDict
from collections.abc import Sequence

from replicas.engine.request import Request
from replicas.kv.hashing import BlockHash

RAY_PREFIX_TREE_MODULE = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree"


class ApproxPrefixTree:
    def __init__(self, num_replicas: int, capacity_blocks: int | None = None) -> None:
        """``capacity_blocks``: per-replica limit enforced at insert (LRU), None for none."""
        self.num_replicas = num_replicas
        self.capacity_blocks = capacity_blocks
        self._holders: dict[BlockHash, int] = {}  # hash -> bit mask of replicas holding it
        self._lru: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_replicas)]

    def size_blocks(self, replica: int) -> int:
        return len(self._lru[replica])

    def insert(self, replica: int, block_hashes: Sequence[BlockHash]) -> None:
        """Record that ``replica`` now holds this prefix (mutates; most recent use)."""
        lru, bit = self._lru[replica], 1 << replica
        holders = self._holders
        for block_hash in reversed(block_hashes):
            if block_hash in lru:
                lru.move_to_end(block_hash)
            else:
                lru[block_hash] = None
                holders[block_hash] = holders.get(block_hash, 0) | bit
        if self.capacity_blocks is not None:
            self.prune(replica, self.capacity_blocks)

    def prune(self, replica: int, max_blocks: int) -> int:
        """Evict least recently used blocks of ``replica`` down to ``max_blocks``; returns how
        many were evicted."""
        lru, bit = self._lru[replica], 1 << replica
        num_evicted = 0
        while len(lru) > max_blocks:
            block_hash, _ = lru.popitem(last=False)
            mask = self._holders[block_hash] & ~bit
            if mask:
                self._holders[block_hash] = mask
            else:
                del self._holders[block_hash]
            num_evicted += 1
        return num_evicted

    def match(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Leading blocks of ``block_hashes`` each replica holds (read-only)."""
        matched = [0] * self.num_replicas
        still = (1 << self.num_replicas) - 1
        for depth, block_hash in enumerate(block_hashes):
            held = self._holders.get(block_hash, 0) & still
            for replica in _bits(still & ~held):
                matched[replica] = depth
            still = held
            if not still:
                return matched
        for replica in _bits(still):
            matched[replica] = len(block_hashes)
        return matched


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class BlockTenantTree:
    """Ray's tenant-tree interface over ``ApproxPrefixTree`` (used when Ray's own tree does not
    import): match in tokens and the tenants owning the deepest match, smallest tenants."""

    implementation = "block-level reimplementation (benchmarks.sim.prefix_tree)"

    def __init__(self, num_replicas: int) -> None:
        self.tree = ApproxPrefixTree(num_replicas)

    def match(self, request: Request) -> tuple[int, list[int]]:
        matched = self.tree.match(request.block_hashes)
        best = max(matched)
        return best * request.block_size, [r for r, m in enumerate(matched) if m == best]

    def smallest_tenants(self) -> list[int]:
        sizes = [self.tree.size_blocks(r) for r in range(self.tree.num_replicas)]
        return [r for r, size in enumerate(sizes) if size == min(sizes)]

    def insert(self, request: Request, replica: int, now: float) -> None:
        self.tree.insert(replica, request.block_hashes)


class RayTenantTree:
    """Ray Serve LLM's own ``PrefixTree`` (character radix tree), on the prompt's token ids as
    characters."""

    implementation = "ray.llm PrefixTree (installed ray package)"

    def __init__(self, num_replicas: int, tree_class: type) -> None:
        self.tree = tree_class()
        self.tree.add_tenants([str(r) for r in range(num_replicas)], 0.0)

    def match(self, request: Request) -> tuple[int, list[int]]:
        text, tenants = self.tree.prefix_match(_text(request))
        return len(text), sorted(int(t) for t in tenants or ())

    def smallest_tenants(self) -> list[int]:
        return sorted(int(t) for t in self.tree.get_smallest_tenants() or ())

    def insert(self, request: Request, replica: int, now: float) -> None:
        self.tree.insert(_text(request), str(replica), now)


def _text(request: Request) -> str:
    return "".join(map(chr, request.prompt_token_ids))


@functools.cache
def ray_prefix_tree_class() -> type | None:
    """Ray Serve LLM's ``PrefixTree`` class, or None where it does not import (it needs the
    ray[serve] extras). Tried once per process."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(RAY_PREFIX_TREE_MODULE)
    except Exception:  # a missing ray[serve] extra, or any other import-time failure
        return None
    return module.PrefixTree


def make_tenant_tree(num_replicas: int) -> "BlockTenantTree | RayTenantTree":
    """Ray's own prefix tree where it imports, else the block-level reimplementation."""
    tree_class = ray_prefix_tree_class()
    if tree_class is None:
        return BlockTenantTree(num_replicas)
    return RayTenantTree(num_replicas, tree_class)
