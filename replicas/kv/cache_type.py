"""One cache type of a manager: its tiers as an ordered list and each request's blocks.

A dense model has one cache type, ``full``; a hybrid model adds ``sliding`` for its
sliding-window layers. Each has its own tiers (``replicas.kv.tiers``: NPU, then host and the
backing tiers behind it, disk among them, when on) over the same block hashes; residency is
derived from the tiers' maps, never kept in parallel flags::

    NPU only       h in the NPU map, not the host map    reusable now; lost on NPU eviction
    host only      h in the host map, not the NPU map    reload into a new NPU block first
    NPU and host   h in both maps                        reusable now; survives NPU eviction
"""

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import NamedTuple

from replicas.kv.block_pool import BlockPool
from replicas.kv.events import Tier, safe_prefix_length
from replicas.kv.free_block_queue import DECAY, RETAINED_PRIORITIES
from replicas.kv.hashing import BlockHash
from replicas.kv.records import CacheTypeMatch, CacheTypeSpec, CacheTypeUsage
from replicas.kv.retention import (
    PolicyContext,
    PolicyFactory,
    RetentionTracker,
    WriteThrough,
    policy_names,
)
from replicas.kv.tiers import BackingStore, TierLevel, order_tiers
from replicas.kv.tiers import host as host_tier
from replicas.kv.tiers import npu as npu_tier


@dataclass(slots=True)
class CacheType:
    """One cache type: its tiers, nearest to compute first, and each request's blocks.
    ``npu`` and ``host`` name the pooled levels for the rules that move blocks between them;
    ``backing`` lists the levels behind host; ``handover`` is the level a resize hands blocks
    over through (the first backing tier a node's replicas share; its store is a
    ``replicas.kv.tiers.HandoverStore``)."""

    spec: CacheTypeSpec
    tiers: list[TierLevel]
    retention: RetentionTracker | None = None  # with a host tier
    blocks: dict[str, list[int | None]] = field(default_factory=dict)  # None: released
    num_cached: dict[str, int] = field(default_factory=dict)  # leading blocks hashed
    num_retained: dict[str, int] = field(default_factory=dict)  # leading blocks retained
    # Derived from ``tiers`` (kept in step by __post_init__ and add_tier), read on hot paths:
    pools: list[BlockPool] = field(init=False)  # the pooled tiers', in order
    pooled_tiers: list[Tier] = field(init=False)
    npu: BlockPool = field(init=False)
    host: BlockPool | None = field(init=False)
    backing: list[TierLevel] = field(init=False)
    handover: TierLevel | None = field(init=False)

    def __post_init__(self) -> None:
        self.tiers = order_tiers(self.tiers)
        pooled = [level for level in self.tiers if level.is_pooled]
        self.pools = [level.pool for level in pooled]
        self.pooled_tiers = [level.tier for level in pooled]
        self.npu = self.tiers[0].pool
        host = self.level(Tier.HOST)
        self.host = host.pool if host is not None else None
        self.backing = [level for level in self.tiers if not level.is_pooled]
        shared = (b for b in self.backing if b.tier.traits.shared_by_node)
        self.handover = next(shared, None)  # its store is a HandoverStore

    @property
    def name(self) -> str:
        return self.spec.name

    def level(self, tier: Tier) -> TierLevel | None:
        return next((level for level in self.tiers if level.tier == tier), None)

    def store_of(self, tier: str) -> BackingStore:
        """The store of backing tier ``tier``."""
        return self.level(Tier(tier)).store

    def add_tier(self, level: TierLevel) -> None:
        self.tiers = [*self.tiers, level]
        self.__post_init__()

    def on_host(self, block_hash: BlockHash) -> bool:
        return self.host is not None and self.host.lookup(block_hash) is not None

    def in_pools(self, block_hash: BlockHash) -> bool:
        """Whether a tier whose blocks a request adopts directly (NPU, host) holds the block."""
        for pool in self.pools:  # noqa: SIM110 (a loop, not any(): called for every block)
            if pool.lookup(block_hash) is not None:
                return True
        return False

    def anywhere(self, block_hash: BlockHash) -> bool:
        """Whether any tier holds the block (backing tiers included)."""
        return any(level.holds(block_hash) for level in self.tiers)

    def usage(self) -> CacheTypeUsage:
        return CacheTypeUsage({level.tier: level.usage() for level in self.tiers})

    # ---- per cache type parts of the manager's operations ---------------------------------------
    def safe_length(self, hashes: list[BlockHash], limit: int, block_size: int) -> int:
        """Longest ``L <= limit`` whose window of this cache type's blocks is in a pooled tier."""
        present = [self.in_pools(h) for h in hashes[:limit]]
        return safe_prefix_length(present, limit, block_size, self.spec.sliding_window)

    def match(self, hashes: list[BlockHash], length: int, block_size: int) -> CacheTypeMatch:
        """This cache type's part of a ``length``-block prefix match (no mutation)."""
        first = self.spec.window_start(length * block_size, block_size)
        window = hashes[first:length]
        ids = {t: [p.lookup(h) for h in window] for t, p in zip(self.pooled_tiers, self.pools)}
        return CacheTypeMatch(first, ids)

    def num_blocks_needed(self, request_id: str, total: int, part: CacheTypeMatch | None) -> int:
        """Free NPU blocks that growing the request to ``total`` blocks, adopting ``part``
        first if given, consumes (no mutation)."""
        held = len(self.blocks.get(request_id, ()))
        adopted = revived = 0
        if part is not None:
            held = part.first_block  # released placeholders before the window
            npu_ids = [b for b in part.block_ids(Tier.NPU) if b is not None]
            adopted = len(npu_ids)
            revived = sum(1 for b in npu_ids if self.npu.blocks[b].ref_count == 0)
        return total - held - adopted + revived

    def release_out_of_window(self, request_id: str, first_needed: int) -> int:
        """Release the request's NPU blocks before block ``first_needed`` (they stay cached);
        returns how many."""
        blocks = self.blocks[request_id]
        stale = [i for i in range(min(first_needed, len(blocks))) if blocks[i] is not None]
        if stale:
            self.npu.free([blocks[i] for i in reversed(stale)])
            for i in stale:
                blocks[i] = None
        return len(stale)

    def free(
        self,
        request_id: str,
        keep: "Collection[int]" = (),
        batch: bool = False,
        lifetime_s: float | None = None,
    ) -> None:
        """Release the request's blocks, deepest first, and forget its progress; ``keep``: empty
        blocks whose contents may still be read (``BlockPool.free``); ``batch``, ``lifetime_s``:
        the request's priority class and protection (``BlockPool.mark``)."""
        blocks = self.blocks.pop(request_id, [])
        self.num_cached.pop(request_id, None)
        self.num_retained.pop(request_id, None)
        self.npu.mark(blocks, batch, lifetime_s)
        self.npu.free([b for b in reversed(blocks) if b is not None], keep)

    def reset(self, tiers: tuple[Tier, ...]) -> list[tuple[Tier, BlockHash]]:
        """Forget the unreferenced cached blocks of ``tiers``, nearest first; returns the
        (tier, hash) removals to announce (a store that announces its own returns none)."""
        return [
            (level.tier, block_hash)
            for level in self.tiers
            if level.tier in tiers
            for block_hash in level.keeper.reset()
        ]

    def expire_retained(self) -> None:
        """End the retentions whose deadline has passed in every tier behind the NPU."""
        for level in self.tiers[1:]:
            level.expire_retained()

    def check_integrity(self, reserved: list[list[int]]) -> None:
        """Every pool's own check, and each NPU block referenced exactly as often as request
        block tables and ``reserved`` hold it."""
        for pool in self.pools:
            pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in [*self.blocks.values(), *reserved]:
            for b in blocks:
                if b is not None:
                    held[b] = held.get(b, 0) + 1
        for block in self.npu.blocks:
            assert block.ref_count == held.get(block.block_id, 0), (
                f"{self.npu.name} block {block.block_id} ref_count {block.ref_count} but "
                f"held {held.get(block.block_id, 0)} times"
            )


class HostRules(NamedTuple):
    """The host tier's configured rules (``KVCacheManager``'s options of the same names)."""

    write_through_threshold: WriteThrough
    write_back: bool
    retention: "str | PolicyFactory"
    curve_sample_rate: float | None
    retained_priority: str = DECAY  # how retained host blocks are ordered in eviction


def build_cache_types(
    specs: list[CacheTypeSpec],
    retained_share: float,
    clock: Callable[[], float],
    host_rules: HostRules,
    backing: dict[str, dict[str, BackingStore]] | None,
) -> tuple[list[CacheType], HostRules]:
    """The cache types with their tiers and, with a host tier, their retention trackers; and
    the host rules in effect (none without a host tier). ``backing``: per backing tier, its
    store per cache type."""
    if specs[0].sliding_window is not None:
        raise ValueError("the first cache type must be global attention")
    priority = host_rules.retained_priority
    cache_types = [build_cache_type(spec, retained_share, clock, priority) for spec in specs]
    has_host = all(c.host is not None for c in cache_types)
    if any(c.host is not None for c in cache_types) and not has_host:
        raise ValueError("every cache type needs host blocks when the host tier is on")
    write_through = host_rules.write_through_threshold if has_host else 0
    write_back = host_rules.write_back and has_host
    for cache_type in cache_types if has_host else ():
        context = PolicyContext(cache_type.spec.num_host_blocks, write_back, write_through)
        cache_type.retention = RetentionTracker(
            host_rules.retention, context, host_rules.curve_sample_rate
        )
    for tier, stores in (backing or {}).items():
        add_backing(cache_types, tier, stores, has_host)
    return cache_types, host_rules._replace(
        write_through_threshold=write_through, write_back=write_back
    )


def build_cache_type(
    spec: CacheTypeSpec,
    retained_share: float,
    clock: Callable[[], float],
    retained_priority: str = DECAY,
) -> CacheType:
    """A cache type with its NPU tier and, with host blocks, its host tier (its retained
    blocks ordered by ``retained_priority``)."""
    levels = [npu_tier.level(spec)]
    if spec.num_host_blocks > 0:
        levels.append(host_tier.level(spec, retained_share, clock, retained_priority))
    return CacheType(spec, levels)


def add_backing(
    cache_types: list[CacheType], tier: str, stores: dict[str, BackingStore], has_host: bool
) -> None:
    """Put each cache type's store of backing tier ``tier`` behind its host tier."""
    if stores and not has_host:
        raise ValueError(f"the {tier} tier needs the host tier: its blocks load through it")
    for cache_type in cache_types if stores else ():
        if cache_type.name not in stores:
            raise ValueError(f"the {tier} tier has no store for cache type {cache_type.name!r}")
        cache_type.add_tier(TierLevel(Tier(tier), store=stores[cache_type.name]))
        cache_type.retention.behind_disk = True


def check_options(
    retained_share: float,
    reservation_share: float,
    retention: "str | PolicyFactory",
    retained_priority: str = DECAY,
) -> None:
    """The manager's options that no config checked before it (a test, the simulator)."""
    if not 0.0 <= retained_share <= 1.0:
        raise ValueError(f"retained_share must be in [0, 1], got {retained_share}")
    if retained_priority not in RETAINED_PRIORITIES:
        raise ValueError(
            f"retained_priority must be one of {RETAINED_PRIORITIES}, got {retained_priority!r}"
        )
    if not 0.0 <= reservation_share <= 1.0:
        raise ValueError(f"reservation_share must be in [0, 1], got {reservation_share}")
    if not callable(retention) and retention not in policy_names():
        raise ValueError(f"retention must be one of {policy_names()}, got {retention!r}")
