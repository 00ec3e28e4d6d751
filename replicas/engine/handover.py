"""A resize's hand-over of cached blocks, run by an engine between its steps
(``replicas.kv.handover`` plans the rounds): a draining replica writes its hot blocks to its
node's disk; a new replica reads the node's disk blocks, then its peers' hottest ones, into its
host tier; a survivor of a scale-in reads the leaving replica's hottest blocks into its host
tier, through the peer tier, across nodes.

Every function here runs on the engine thread while the engine does not step.
"""

import time
from typing import TYPE_CHECKING

from replicas.cache_hints import PeerSource
from replicas.kv.handover import HANDOVER_BATCH_BLOCKS, WarmSource, WarmStart
from replicas.kv.hashing import BlockHash

if TYPE_CHECKING:
    from replicas.engine.engine import Engine
    from replicas.kv.tiers import BackingStore

PEER_TIER = "peer"


def handover_stores(engine: "Engine") -> "list[BackingStore]":
    """The stores of the tier a resize hands blocks over through on a node (disk), per cache
    type."""
    tier = engine.kv_cache.handover_tier
    return list(engine.backing[tier].values()) if tier is not None else []


def write_out(engine: "Engine", time_budget_s: float) -> int:
    """Write the NPU and host blocks the node's disk tier lacks to this replica's slab, hottest
    first, in rounds until done or ``time_budget_s`` has passed (checked between rounds), never
    replacing a hotter disk block by a colder one; returns the blocks whose writes landed (0
    without a disk tier)."""
    stores = handover_stores(engine)
    if not stores:
        return 0
    deadline = time.monotonic() + time_budget_s
    engine.core.flush_transfers(wait=True)
    writing = engine.kv_cache.start_write_out()
    num_written = 0
    while not writing.is_done and time.monotonic() < deadline:
        num_stores = writing.plan_round(HANDOVER_BATCH_BLOCKS)
        engine.core.flush_transfers(wait=True)
        left_s = max(0.0, deadline - time.monotonic())
        if all([store.flush(left_s) for store in stores]):
            num_written += num_stores
    writing.end()
    return num_written


def warm_from_disk(engine: "Engine", time_budget_s: float) -> int:
    """Read the node's disk blocks (every replica's slab) into empty host blocks, hottest first,
    until the host tier or the disk has no more or ``time_budget_s`` has passed; returns the
    blocks loaded by then (0 without a disk or host tier)."""
    if not handover_stores(engine) or engine.transfer is None:
        return 0
    return _warm(engine, engine.kv_cache.start_warm(), engine.kv_cache.handover_tier, time_budget_s)


def warm_from_peers(
    engine: "Engine",
    sources: list[tuple[PeerSource, dict[BlockHash, float]]],
    time_budget_s: float,
    max_share: float = 0.0,
) -> int:
    """Read blocks other replicas hold (each source with the hashes to ask it for and their hit
    weights; a hash two name is asked of the one with the higher weight) into host blocks,
    through the peer tier, hottest first: into empty ones, and up to ``max_share`` of the host
    tier in all (evicting its least recently used cached blocks). Returns the blocks loaded
    within ``time_budget_s`` (0 without a peer or host tier)."""
    stores = engine.backing.get(PEER_TIER)
    if not stores or engine.transfer is None:
        return 0
    best: dict[BlockHash, tuple[float, int]] = {}  # hash -> (weight, source position)
    for position, (_, weights) in enumerate(sources):
        for block_hash, weight in weights.items():
            if block_hash not in best or weight > best[block_hash][0]:
                best[block_hash] = (weight, position)
    chosen: list[list[BlockHash]] = [[] for _ in sources]
    for block_hash, (_, position) in best.items():
        chosen[position].append(block_hash)
    for (source, _), hashes in zip(sources, chosen):
        for store in stores.values():
            store.offer(hashes, source)
    order = sorted(best, key=lambda h: best[h][0], reverse=True)
    warm = engine.kv_cache.start_warm(WarmSource(PEER_TIER, order, max_share))
    return _warm(engine, warm, PEER_TIER, time_budget_s)


def _warm(engine: "Engine", warm: WarmStart, tier: str, time_budget_s: float) -> int:
    """Run a warm start's rounds until done or ``time_budget_s`` has passed; the blocks of
    ``tier`` loaded by then (reads still in flight land later)."""
    deadline = time.monotonic() + time_budget_s
    loaded_before = engine.kv_cache.stats.tier(tier).blocks_loaded
    while not warm.is_done and time.monotonic() < deadline:
        if not warm.plan_round(HANDOVER_BATCH_BLOCKS):
            break
        engine.core.flush_transfers()
        engine.core.complete_backing_loads(max(0.0, deadline - time.monotonic()))
    return engine.kv_cache.stats.tier(tier).blocks_loaded - loaded_before
