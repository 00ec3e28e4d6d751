"""Records the KV cache manager hands out: cache types, prefix matches, transfer plans, usage and
stats."""

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, NamedTuple

from replicas.kv.events import Tier, backing_tiers, tiers, window_start

if TYPE_CHECKING:
    from replicas.kv.partial_blocks import PartialBlock


def copy_path(src: str, dst: str) -> str:
    """The ``TransferPlan`` field that copies blocks from tier ``src`` to the adjacent tier
    ``dst``: NPU and host trade ``stores`` and ``loads``; every backing tier hangs off host,
    through ``backing_stores`` and ``backing_loads`` (each copy names its tier)."""
    src, dst = Tier(src), Tier(dst)
    paths = {(Tier.HOST, Tier.NPU): "loads", (Tier.NPU, Tier.HOST): "stores"}
    if (src, dst) in paths:
        return paths[(src, dst)]
    if dst == Tier.HOST and not src.traits.pooled:
        return "backing_loads"
    if src == Tier.HOST and not dst.traits.pooled:
        return "backing_stores"
    raise ValueError(f"no copy path from tier {src!r} to tier {dst!r}")


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
    1`` per pooled tier, nearest to compute first; ``block_ids(tier)[i]`` is the tier's block
    holding block i, None if it has none. A block comes from the nearest tier holding it (from
    host when its NPU entry is None). Disk blocks are never matched: they are read into host
    blocks first."""

    first_block: int
    tier_block_ids: dict[Tier, list[int | None]]

    @property
    def num_blocks(self) -> int:
        return len(self.tier_block_ids[Tier.NPU])

    def block_ids(self, tier: Tier) -> list[int | None]:
        """The matched blocks' ids in one pooled tier (all None for a pooled tier this cache
        type lacks)."""
        ids = self.tier_block_ids.get(tier)
        if ids is not None:
            return ids
        if tier not in POOLED_TIERS:
            raise ValueError(f"a prefix match holds NPU and host blocks, not {tier!r}")
        return [None] * self.num_blocks

    def num_blocks_by_source(self) -> dict[Tier, int]:
        """Matched blocks per tier they come from (the nearest holding each)."""
        counts = {}
        remaining = range(self.num_blocks)
        for tier, ids in self.tier_block_ids.items():
            counts[tier] = sum(1 for i in remaining if ids[i] is not None)
            remaining = [i for i in remaining if ids[i] is None]
        return counts


POOLED_TIERS = (Tier.NPU, Tier.HOST)
"""The tiers whose blocks a prefix match adopts (through a load for any but the first)."""

EMPTY_PART = CacheTypeMatch(0, {Tier.NPU: []})


class PrefixMatch(NamedTuple):
    """The longest *safe* cached prefix of a request: ``num_blocks`` leading blocks whose global
    KV exists for all of them and whose sliding-window KV exists for the window ending there.
    ``num_blocks_by_tier`` splits the primary (first, global) cache type's blocks by the nearest
    tier holding each."""

    num_blocks: int
    num_blocks_by_tier: dict[Tier, int]
    cache_types: dict[str, CacheTypeMatch]
    # After the whole blocks: a freed partial block whose first ``num_tail_tokens`` are the
    # request's next tokens, copied into a block of its own (``replicas.kv.partial_blocks``).
    tail: "PartialBlock | None" = None
    num_tail_tokens: int = 0

    def num_tokens(self, block_size: int) -> int:
        """Tokens the match gives: its whole blocks and the partial block's tokens."""
        return self.num_blocks * block_size + self.num_tail_tokens

    @property
    def primary(self) -> CacheTypeMatch:
        return next(iter(self.cache_types.values()), EMPTY_PART)

    def num_blocks_in(self, tier: Tier) -> int:
        """Blocks of the primary cache type that come from ``tier``."""
        return self.num_blocks_by_tier.get(tier, 0)


EMPTY_MATCH = PrefixMatch(0, {}, {})


class BlockCopy(NamedTuple):
    """One block to copy between tiers within one cache type. A ``prefetch`` load is for a
    request still waiting (a reservation), not for this step's batch; it is copied, and waited
    for, like any other load of the step's plan."""

    src: int
    dst: int
    cache_type: str = "full"
    prefetch: bool = False


class BackingCopy(NamedTuple):
    """One block to copy between the host tier and a backing tier (``tier``, disk by default):
    ``host_id`` is the host block a store reads or a load fills; ``block_hash`` names the block
    in the backing tier. A store ``locked`` holds a reference on its host block until the plan
    lands; a write-back store does not (host allocation takes that block in the same plan,
    whose stores run after it)."""

    host_id: int
    block_hash: bytes
    cache_type: str = "full"
    locked: bool = True
    retained_until: float = 0.0  # a store of a retained block: the tier keeps it until then
    weight: float = 0.0  # a store's hit weight (``replicas.kv.hotness``), kept in its record
    tier: str = "disk"
    batch: bool = False  # a store of a batch block: the tier replaces it before the others
    tenant: int = 0  # a store's tenant (``replicas.kv.tenants``; 0: nobody's)


class TransferPlan(NamedTuple):
    """Copies of one engine step, in the order they run: backing stores (host -> a backing
    tier such as disk, reading host blocks before this plan's stores overwrite them), stores
    (NPU -> host), loads (host -> NPU), backing loads (a backing tier -> host, landing after
    the step, in the background). Beside them,
    ``block_copies`` within the NPU tier (a partial block's computed tokens for the request
    that continues them, ``replicas.kv.partial_blocks``), which the model executor runs before
    the step's forward pass; their sources are held until the plan is taken, so no copy of
    this plan writes them. Stores run before loads and both before the next forward pass, so a
    store reads an evicted block before new KV overwrites it and a load lands before attention
    reads it; host blocks stay locked (ref count) while a copy involving them is in flight."""

    stores: list[BlockCopy]
    loads: list[BlockCopy]
    backing_stores: tuple[BackingCopy, ...] = ()
    backing_loads: tuple[BackingCopy, ...] = ()
    block_copies: tuple[BlockCopy, ...] = ()

    def __bool__(self) -> bool:
        """Whether there is anything for the transfer component (``block_copies`` is not)."""
        return bool(self.stores or self.loads or self.backing_stores or self.backing_loads)

    def copies(self, src: str, dst: str) -> "list[BlockCopy] | tuple[BackingCopy, ...]":
        """The copies from tier ``src`` to the adjacent tier ``dst``."""
        copies = getattr(self, copy_path(src, dst))
        backing = dst if src == Tier.HOST else src
        if Tier(backing).traits.pooled:
            return copies
        return tuple(c for c in copies if c.tier == backing)


class PlannedCopies:
    """The copies planned since the last ``take``, by the manager and its collaborators, in
    the fields of the ``TransferPlan`` they go to."""

    __slots__ = ("backing_loads", "backing_stores", "block_copies", "loads", "stores")

    def __init__(self) -> None:
        self.stores: list[BlockCopy] = []
        self.loads: list[BlockCopy] = []
        self.backing_stores: list[BackingCopy] = []
        self.backing_loads: list[BackingCopy] = []
        self.block_copies: list[BlockCopy] = []

    def take(self) -> TransferPlan:
        """The planned copies as one plan; nothing is planned after."""
        plan = TransferPlan(
            self.stores,
            self.loads,
            tuple(self.backing_stores),
            tuple(self.backing_loads),
            tuple(self.block_copies),
        )
        self.stores, self.loads = [], []
        self.backing_stores.clear()
        self.backing_loads.clear()
        self.block_copies.clear()
        return plan


class TierUsage(NamedTuple):
    """Blocks of one tier of one cache type: capacity, in use (held by requests or transfers),
    cached (holding a reusable prefix, in use or evictable) and retained (kept ahead of
    ordinary blocks: prompt-cache retention). A shared tier (disk) counts its own blocks."""

    num_blocks: int = 0
    num_used: int = 0
    num_cached: int = 0
    num_retained: int = 0


NO_USAGE = TierUsage()


@dataclass(frozen=True, slots=True)
class CacheTypeUsage:
    """Blocks of one cache type per tier, nearest to compute first; a tier that is off is
    absent (``of`` reads it as zeros)."""

    tiers: dict[Tier, TierUsage]

    def of(self, tier: Tier) -> TierUsage:
        return self.tiers.get(tier, NO_USAGE)

    def retained_by_tier(self) -> dict[Tier, int]:
        """Retained blocks per tier that can retain (every tier behind the NPU) and is on."""
        return {t: u.num_retained for t, u in self.by_tier_usage().items() if t != Tier.NPU}

    def by_tier(self) -> dict[Tier, tuple[int, int, int]]:
        """(capacity, in use, cached) per tier that is on, nearest to compute first."""
        tiers = self.by_tier_usage()
        return {t: (u.num_blocks, u.num_used, u.num_cached) for t, u in tiers.items()}

    def by_tier_usage(self) -> dict[Tier, TierUsage]:
        """The usage of every tier that is on (the NPU tier always; another with capacity)."""
        return {t: u for t, u in self.tiers.items() if t == Tier.NPU or u.num_blocks}


class _Evictions:
    """``npu_evictions`` and ``host_evictions``: a stats record's ``evictions`` by tier, under
    the names the metrics and reports use."""

    __slots__ = ()
    evictions: dict[Tier, int]

    @property
    def npu_evictions(self) -> int:
        return self.evictions.get(Tier.NPU, 0)

    @property
    def host_evictions(self) -> int:
        return self.evictions.get(Tier.HOST, 0)


@dataclass(slots=True)
class CacheTypeStats(_Evictions):
    """Block counters of one cache type (``npu_evictions`` and ``host_evictions`` read
    ``evictions``, the names the metrics and reports use)."""

    evictions: dict[Tier, int] = field(default_factory=dict)  # cached blocks evicted, per tier
    write_through_promotions: int = 0
    write_backs: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    blocks_freed_out_of_window: int = 0


@dataclass(slots=True)
class BackingStats:
    """Counters of one backing tier (blocks of every cache type; requests for the rest)."""

    blocks_loaded: int = 0  # tier -> host copies that landed with a valid block
    load_failures: int = 0  # reads that missed (checksum, changed slot, missing file)
    blocks_stored: int = 0  # host -> tier copies handed to the tier's store
    reloads: int = 0  # waiting requests whose prefix was read from it (the cost rule's yes)
    recomputes: int = 0  # ... whose prefix there was recomputed instead (the rule's no)
    load_timeouts: int = 0  # requests admitted without a read from it that took too long
    write_back_skips: int = 0  # host evictions the adaptive policy did not store to it


@dataclass(slots=True)
class CacheStats(_Evictions):
    """Monotonic counters of one replica's prefix cache. Tokens for queries and hits (the safe
    prefix; ``hits_by_source`` splits it by the tier its global KV came from); blocks, summed
    over cache types, for the rest, with the split per cache type in ``by_cache_type``. The
    ``count_*`` methods move a total and its cache type's share together. The per-tier counts
    live in mappings keyed by tier; ``npu_hits``, ``host_hits`` (disk hits included: they reach
    NPU through host), ``disk_hits``, ``npu_evictions`` and ``host_evictions`` read them under
    the names the metrics, ``LLM.stats()`` and the reports use."""

    queries: int = 0
    hits: int = 0
    hits_by_source: dict[Tier, int] = field(default_factory=dict)  # tokens, by where they came from
    evictions: dict[Tier, int] = field(default_factory=dict)  # cached blocks evicted, per tier
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
    backing: dict[str, "BackingStats"] = field(default_factory=dict)  # per backing tier
    by_cache_type: dict[str, CacheTypeStats] = field(default_factory=dict)
    by_tenant: dict[int, tuple[int, int]] = field(default_factory=dict)  # -> (queries, hits)

    @property
    def npu_hits(self) -> int:
        return self.hits_by_source.get(Tier.NPU, 0)

    @property
    def host_hits(self) -> int:
        """Hit tokens loaded from host, those read from disk into host first included."""
        return sum(n for tier, n in self.hits_by_source.items() if tier != Tier.NPU)

    @property
    def disk_hits(self) -> int:
        return self.hits_by_source.get(Tier.DISK, 0)

    def __getattr__(self, name: str) -> int:
        """A backing tier's counter under its flat name, ``<tier>_<counter>`` (``disk_reloads``;
        0 before the tier counts anything)."""
        tier, _, counter = name.partition("_")
        if counter in BackingStats.__slots__ and tier in backing_tiers():
            stats = self.backing.get(tier)
            return getattr(stats, counter) if stats is not None else 0
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def tier(self, tier: str) -> "BackingStats":
        """A backing tier's counters, created on its first count."""
        return self.backing.setdefault(Tier(tier), BackingStats())

    def counters(self) -> dict[str, int]:
        """Every counter under the flat name the reports use: the integer fields, the per-tier
        counts as ``npu_hits``, ``host_hits``, ``disk_hits``, ``npu_evictions`` and
        ``host_evictions``, and a backing tier's as ``<tier>_<counter>`` (disk's always, any
        other's once it counted)."""
        flat = {f.name: getattr(self, f.name) for f in fields(self)}
        flat = {name: value for name, value in flat.items() if isinstance(value, int)}
        for name in ("npu_hits", "host_hits", "disk_hits", "npu_evictions", "host_evictions"):
            flat[name] = getattr(self, name)
        for tier in dict.fromkeys([Tier.DISK, *self.backing]):  # disk's always, as before
            for counter in BackingStats.__slots__:
                flat[f"{tier}_{counter}"] = getattr(self, f"{tier}_{counter}")
        return flat

    def hits_by_tier(self) -> dict[Tier, int]:
        """Hit tokens by the tier their global KV came from, nearest to compute first: NPU and
        host always, a deeper tier once it served some (a disk hit reaches NPU through host:
        ``host_hits`` counts it too, this view does not)."""
        hits = self.hits_by_source
        return {
            tier: hits.get(tier, 0)
            for tier in tiers()
            if tier in (Tier.NPU, Tier.HOST) or hits.get(tier, 0)
        }

    def count_hits(self, tier: Tier, num_tokens: int) -> None:
        """Count hit tokens that came from ``tier`` (a new request's, at admission)."""
        self.hits_by_source[tier] = self.hits_by_source.get(tier, 0) + num_tokens

    def count_eviction(self, cache_type: str, tier: Tier) -> None:
        self.evictions[tier] = self.evictions.get(tier, 0) + 1
        per_type = self._of(cache_type).evictions
        per_type[tier] = per_type.get(tier, 0) + 1

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
