"""One cache type of a manager: its tiers as an ordered list and each request's blocks.

A dense model has one cache type, ``full``; a hybrid model adds ``sliding`` for its
sliding-window layers. Each has its own tiers (``replicas.kv.tiers``: NPU, then host and disk
when on) over the same block hashes; residency is derived from the tiers' maps, never kept in
parallel flags.
"""

from collections.abc import Collection
from dataclasses import dataclass, field

from replicas.kv.block_pool import BlockPool
from replicas.kv.events import Tier, safe_prefix_length
from replicas.kv.hashing import BlockHash
from replicas.kv.records import CacheTypeMatch, CacheTypeSpec, CacheTypeUsage
from replicas.kv.retention import RetentionTracker
from replicas.kv.tiers import DiskIndex, TierLevel, order_tiers


@dataclass(slots=True)
class CacheType:
    """One cache type: its tiers, nearest to compute first, and each request's blocks.
    ``npu``, ``host`` and ``disk`` name the levels for the rules that move blocks between two
    particular tiers."""

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
    disk: DiskIndex | None = field(init=False)

    def __post_init__(self) -> None:
        self.tiers = order_tiers(self.tiers)
        pooled = [level for level in self.tiers if level.is_pooled]
        self.pools = [level.pool for level in pooled]
        self.pooled_tiers = [level.tier for level in pooled]
        self.npu = self.tiers[0].pool
        host, disk = self.level(Tier.HOST), self.level(Tier.DISK)
        self.host = host.pool if host is not None else None
        self.disk = disk.store if disk is not None else None

    @property
    def name(self) -> str:
        return self.spec.name

    def level(self, tier: Tier) -> TierLevel | None:
        return next((level for level in self.tiers if level.tier == tier), None)

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
        """Whether any tier holds the block (disk included)."""
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

    def free(self, request_id: str, keep: "Collection[int]" = ()) -> None:
        """Release the request's blocks, deepest first, and forget its progress; ``keep``: empty
        blocks whose contents may still be read (``BlockPool.free``)."""
        blocks = self.blocks.pop(request_id, [])
        self.num_cached.pop(request_id, None)
        self.num_retained.pop(request_id, None)
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
