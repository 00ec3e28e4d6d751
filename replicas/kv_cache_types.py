"""Records the KV cache manager hands out: cache groups, prefix matches, transfer plans, stats."""

from dataclasses import dataclass, field
from typing import NamedTuple


class CacheGroupSpec(NamedTuple):
    """One cache type of a replica: the layers of one attention kind, with their own pools.

    ``sliding_window`` is None for global attention. All groups share the block size and the
    block hashes; each has its own NPU pool, host pool and hash-to-block maps.
    """

    name: str  # "full" | "sliding"
    num_npu_blocks: int
    num_host_blocks: int = 0
    sliding_window: int | None = None

    def window_start(self, num_tokens: int, block_size: int) -> int:
        """First block a token at position ``num_tokens`` still attends to (0 for global)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_tokens - self.sliding_window + 1) // block_size


class GroupMatch(NamedTuple):
    """A group's part of a prefix match: entries for blocks ``first_block .. num_blocks - 1``;
    ``npu_block_ids[i]`` is None when that block is host-only (``host_block_ids[i]``)."""

    first_block: int
    npu_block_ids: list[int | None]
    host_block_ids: list[int | None]


class PrefixMatch(NamedTuple):
    """The longest *safe* cached prefix of a request: ``num_blocks`` leading blocks whose global
    KV exists for all of them and whose sliding-window KV exists for the window ending there.
    The NPU/host split counts the primary (first, global) group's blocks."""

    num_blocks: int
    num_npu_blocks: int
    num_host_blocks: int
    groups: dict[str, GroupMatch]

    @property
    def primary(self) -> GroupMatch:
        return next(iter(self.groups.values()))

    @property
    def npu_block_ids(self) -> list[int | None]:
        return self.primary.npu_block_ids

    @property
    def host_block_ids(self) -> list[int | None]:
        return self.primary.host_block_ids


EMPTY_MATCH = PrefixMatch(0, 0, 0, {})


class BlockCopy(NamedTuple):
    """One block to copy between tiers within one cache group."""

    src: int
    dst: int
    group: str = "full"


class TransferPlan(NamedTuple):
    """Copies of one engine step: stores (NPU -> host) run before loads (host -> NPU)."""

    stores: list[BlockCopy]
    loads: list[BlockCopy]

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


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
    with the split per cache type in ``by_cache_type``."""

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
    by_cache_type: dict[str, CacheTypeStats] = field(default_factory=dict)

    def count(self, group: str, counter: str, n: int = 1) -> None:
        setattr(self, counter, getattr(self, counter) + n)
        per_type = self.by_cache_type.setdefault(group, CacheTypeStats())
        setattr(per_type, counter, getattr(per_type, counter) + n)
