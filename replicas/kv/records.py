"""Records the KV cache manager hands out: cache types, prefix matches, transfer plans, usage and
stats."""

from dataclasses import dataclass, field
from typing import NamedTuple

from replicas.kv.events import Tier, window_start

COPY_PATHS: dict[tuple[Tier, Tier], str] = {
    (Tier.HOST, Tier.NPU): "loads",
    (Tier.NPU, Tier.HOST): "stores",
    (Tier.DISK, Tier.HOST): "disk_loads",
    (Tier.HOST, Tier.DISK): "disk_stores",
}
"""The ``TransferPlan`` field that copies blocks from one tier to an adjacent one."""


class CacheTypeSpec(NamedTuple):
    """One cache type of a replica: the layers of one attention kind, with their own pools.

    ``sliding_window`` is None for global attention. All cache types share the block size and
    the block hashes; each has its own NPU pool, host pool and hash-to-block maps.
    """

    name: str  # "full" | "sliding"
    num_npu_blocks: int
    num_host_blocks: int = 0
    sliding_window: int | None = None

    def window_start(self, num_tokens: int, block_size: int) -> int:
        """First block a token at position ``num_tokens`` still attends to (0 for global)."""
        return window_start(num_tokens, block_size, self.sliding_window)


class CacheTypeMatch(NamedTuple):
    """A cache type's part of a prefix match: entries for blocks ``first_block .. num_blocks -
    1``; ``npu_block_ids[i]`` is None when that block is host-only (``host_block_ids[i]``)."""

    first_block: int
    npu_block_ids: list[int | None]
    host_block_ids: list[int | None]

    def block_ids(self, tier: Tier) -> list[int | None]:
        """The matched blocks' ids in one pooled tier (None where that tier lacks the block).
        Disk blocks are never matched: they are read into host blocks first."""
        if tier == Tier.NPU:
            return self.npu_block_ids
        if tier == Tier.HOST:
            return self.host_block_ids
        raise ValueError(f"a prefix match holds NPU and host blocks, not {tier!r}")


EMPTY_PART = CacheTypeMatch(0, [], [])


class PrefixMatch(NamedTuple):
    """The longest *safe* cached prefix of a request: ``num_blocks`` leading blocks whose global
    KV exists for all of them and whose sliding-window KV exists for the window ending there.
    The NPU/host split counts the primary (first, global) cache type's blocks."""

    num_blocks: int
    num_npu_blocks: int
    num_host_blocks: int
    cache_types: dict[str, CacheTypeMatch]

    @property
    def primary(self) -> CacheTypeMatch:
        return next(iter(self.cache_types.values()))

    @property
    def npu_block_ids(self) -> list[int | None]:
        return self.primary.npu_block_ids

    @property
    def host_block_ids(self) -> list[int | None]:
        return self.primary.host_block_ids


EMPTY_MATCH = PrefixMatch(0, 0, 0, {})


class BlockCopy(NamedTuple):
    """One block to copy between tiers within one cache type. A ``prefetch`` load is for a
    request still waiting (a reservation), not for this step's batch: it may overlap compute."""

    src: int
    dst: int
    cache_type: str = "full"
    prefetch: bool = False


class DiskCopy(NamedTuple):
    """One block to copy between the host tier and the disk tier: ``host_id`` is the host block
    a disk store reads or a disk load fills; ``block_hash`` names the block on disk. A store
    ``locked`` holds a reference on its host block until the plan lands; a write-back store does
    not (host allocation takes that block in the same plan, whose stores run after it)."""

    host_id: int
    block_hash: bytes
    cache_type: str = "full"
    locked: bool = True
    retained_until: float = 0.0  # a store of a retained block: the disk keeps it until then


class TransferPlan(NamedTuple):
    """Copies of one engine step, in the order they run: disk stores (host -> disk, reading
    host blocks before this plan's stores overwrite them), stores (NPU -> host), loads (host ->
    NPU), disk loads (disk -> host, landing after the step, in the background)."""

    stores: list[BlockCopy]
    loads: list[BlockCopy]
    disk_stores: tuple[DiskCopy, ...] = ()
    disk_loads: tuple[DiskCopy, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.disk_stores or self.disk_loads)

    def copies(self, src: Tier, dst: Tier) -> "list[BlockCopy] | tuple[DiskCopy, ...]":
        """The copies from tier ``src`` to the adjacent tier ``dst``."""
        return getattr(self, COPY_PATHS[(Tier(src), Tier(dst))])


class CacheTypeUsage(NamedTuple):
    """Blocks of one cache type per tier: capacity, in use (held by requests or transfers) and
    cached (holding a reusable prefix, in use or evictable). Host counts are 0 without a host
    tier."""

    num_npu_blocks: int
    num_npu_blocks_used: int
    num_npu_blocks_cached: int
    num_host_blocks: int
    num_host_blocks_used: int
    num_host_blocks_cached: int
    num_disk_blocks: int = 0  # this replica's own disk slots (other replicas' are readable too)
    num_disk_blocks_cached: int = 0
    num_host_blocks_retained: int = 0  # kept ahead of ordinary blocks (prompt-cache retention)
    num_disk_blocks_retained: int = 0

    def retained_by_tier(self) -> dict[Tier, int]:
        """Retained blocks per tier that can retain (host, disk) and is on."""
        tiers = {}
        if self.num_host_blocks:
            tiers[Tier.HOST] = self.num_host_blocks_retained
        if self.num_disk_blocks:
            tiers[Tier.DISK] = self.num_disk_blocks_retained
        return tiers

    def by_tier(self) -> dict[Tier, tuple[int, int, int]]:
        """(capacity, in use, cached) per tier that is on, nearest to compute first."""
        tiers = {
            Tier.NPU: (self.num_npu_blocks, self.num_npu_blocks_used, self.num_npu_blocks_cached)
        }
        if self.num_host_blocks:
            tiers[Tier.HOST] = (
                self.num_host_blocks,
                self.num_host_blocks_used,
                self.num_host_blocks_cached,
            )
        if self.num_disk_blocks:
            tiers[Tier.DISK] = (self.num_disk_blocks, 0, self.num_disk_blocks_cached)
        return tiers


@dataclass(slots=True)
class CacheTypeStats:
    """Block counters of one cache type."""

    npu_evictions: int = 0
    host_evictions: int = 0
    write_through_promotions: int = 0
    write_backs: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    blocks_freed_out_of_window: int = 0


@dataclass(slots=True)
class CacheStats:
    """Monotonic counters of one replica's prefix cache. Tokens for queries and hits (the safe
    prefix, split by the tier of its global KV); blocks, summed over cache types, for the rest,
    with the split per cache type in ``by_cache_type``. The ``count_*`` methods move a total and
    its cache type's share together."""

    queries: int = 0
    hits: int = 0
    npu_hits: int = 0
    host_hits: int = 0
    npu_evictions: int = 0
    host_evictions: int = 0
    write_through_promotions: int = 0
    write_backs: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    blocks_freed_out_of_window: int = 0
    # Reservations of waiting requests' prefixes (blocks of the primary cache type):
    reserved_blocks: int = 0  # held now (a gauge; the rest are counters)
    reservations: int = 0  # made
    prefetched_blocks: int = 0  # host-only blocks loaded into NPU blocks while their request waited
    prefetched_blocks_used: int = 0  # of those, adopted by their request at admission
    reservations_dropped: int = 0  # given way to running requests (or to an earlier arrival)
    # The disk tier (blocks of every cache type; tokens for disk_hits):
    disk_hits: int = 0  # tokens of admitted prompts whose KV came from disk (within host_hits)
    disk_blocks_loaded: int = 0  # disk -> host copies that landed with a valid block
    disk_load_failures: int = 0  # disk reads that missed (checksum, changed slot, missing file)
    disk_blocks_stored: int = 0  # host -> disk copies handed to the disk store
    disk_reloads: int = 0  # waiting requests whose disk prefix was loaded (the cost rule's yes)
    disk_recomputes: int = 0  # ... whose disk prefix was recomputed instead (the rule's no)
    disk_load_timeouts: int = 0  # requests admitted without a disk load that took too long
    disk_write_back_skips: int = 0  # host evictions the adaptive policy did not store to disk
    by_cache_type: dict[str, CacheTypeStats] = field(default_factory=dict)

    def hits_by_tier(self) -> dict[Tier, int]:
        """Hit tokens by the tier their global KV came from, nearest to compute first (a disk
        hit reaches NPU through host: ``host_hits`` counts it too, this view does not)."""
        hits = {Tier.NPU: self.npu_hits, Tier.HOST: self.host_hits - self.disk_hits}
        if self.disk_hits:
            hits[Tier.DISK] = self.disk_hits
        return hits

    def count_npu_eviction(self, cache_type: str) -> None:
        self.npu_evictions += 1
        self._of(cache_type).npu_evictions += 1

    def count_host_eviction(self, cache_type: str) -> None:
        self.host_evictions += 1
        self._of(cache_type).host_evictions += 1

    def count_write_through_promotion(self, cache_type: str) -> None:
        self.write_through_promotions += 1
        self._of(cache_type).write_through_promotions += 1

    def count_write_back(self, cache_type: str) -> None:
        self.write_backs += 1
        self._of(cache_type).write_backs += 1

    def count_block_loaded(self, cache_type: str) -> None:
        self.blocks_loaded += 1
        self._of(cache_type).blocks_loaded += 1

    def count_block_stored(self, cache_type: str) -> None:
        self.blocks_stored += 1
        self._of(cache_type).blocks_stored += 1

    def count_blocks_freed_out_of_window(self, cache_type: str, num_blocks: int) -> None:
        self.blocks_freed_out_of_window += num_blocks
        self._of(cache_type).blocks_freed_out_of_window += num_blocks

    def _of(self, cache_type: str) -> CacheTypeStats:
        """The cache type's counters, created on its first count."""
        return self.by_cache_type.setdefault(cache_type, CacheTypeStats())
