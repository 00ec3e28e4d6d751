"""What the manager tells one cache type's retention: a policy (``policy.py``) and the
miss-ratio curve (``curve.py``) fed by the same events, and their figures as one record."""

import operator
from dataclasses import dataclass, field

from replicas.kv.hashing import BlockHash
from replicas.kv.retention.curve import MAX_SHADOW_BLOCKS, MissRatioCurve, ShadowKey
from replicas.kv.retention.policy import (
    BlockCosts,
    PolicyContext,
    PolicyFactory,
    RetentionPolicy,
    make_policy,
)


@dataclass(slots=True)
class RetentionStats:
    """One cache type's ghost records, miss-ratio curve and per-block decisions. Every field is a
    count (or a current size; estimates when the curve samples) and adds up across replicas; the
    estimated host hit rate at a point of the curve is ``estimated_host_hit_tokens[key] /
    CacheStats.queries``, comparable with the measured ``CacheStats.host_hits /
    CacheStats.queries``."""

    ghost_hits_dropped: int = 0  # blocks that would have been host hits had write-back kept them
    ghost_hits_host_evicted: int = 0  # blocks the host tier would have served with more room
    num_ghosts_dropped: int = 0
    num_ghosts_host_evicted: int = 0
    estimated_host_hit_tokens: dict[ShadowKey, int] = field(default_factory=dict)
    adaptive_stores: int = 0  # blocks a policy deciding at eviction stored when evicted
    adaptive_skips: int = 0  # blocks it let go


class RetentionTracker:
    """One cache type's retention policy and miss-ratio curve, fed by the manager. Every event
    reaches the curve before the policy, so the curve's shadows ask the policy's decision as the
    manager did."""

    __slots__ = ("_skips", "_stores", "curve", "policy")

    def __init__(
        self,
        policy: "str | PolicyFactory",
        context: PolicyContext,
        sample_rate: float | None = None,
        max_shadow_blocks: int = MAX_SHADOW_BLOCKS,
    ) -> None:
        """``policy``: a registered name or a factory; ``sample_rate``: the share of hashes the
        curve tracks (None: the default rule of ``curve.sample_rate_for``; 1: exact)."""
        if context.num_host_blocks < 1:
            raise ValueError("a retention tracker needs a host tier")
        self.policy: RetentionPolicy = make_policy(policy, context)
        self.curve = MissRatioCurve(self.policy, context, sample_rate, max_shadow_blocks)
        self.policy.watch_curve(self.curve)
        self._stores = 0
        self._skips = 0

    @property
    def behind_disk(self) -> bool:
        """Whether a disk tier sits behind the host tier (set once, when one is attached)."""
        return self.curve.behind_disk

    @behind_disk.setter
    def behind_disk(self, value: bool) -> None:
        if value and not self.curve.behind_disk:
            self.curve.behind_disk = True
            self.policy.disk_attached()

    # ---- the policy's decisions --------------------------------------------------------------
    @property
    def decides_at_eviction(self) -> bool:
        return self.policy.decides_at_eviction

    @property
    def may_store_to_disk(self) -> bool:
        return self.policy.may_store_to_disk

    def should_store(self, block_hash: BlockHash, num_hits: int, host_full: bool) -> bool:
        """Whether a block the NPU tier evicts, with no host copy, is stored to host."""
        return self.policy.should_store(block_hash, num_hits, host_full)

    def should_store_to_disk(self, disk_read_s: float) -> bool:
        """Whether the block the host tier evicts next is stored to disk (asked only when
        ``may_store_to_disk``)."""
        return self.policy.should_store_to_disk(disk_read_s)

    def store_decided(self, stored: bool) -> None:
        """The manager acted on ``should_store`` (counted for a policy deciding at eviction)."""
        if stored:
            self._stores += 1
        else:
            self._skips += 1

    # ---- events ------------------------------------------------------------------------------
    def admitted(self, hashes: list[BlockHash], on_npu: list[bool], on_host: list[bool]) -> None:
        """A new request's prompt blocks (those a match may cover) with their residency before
        the cache serves it."""
        present = list(map(operator.or_, on_npu, on_host))
        served = present.index(False) if False in present else len(present)
        self.curve.admitted(hashes, on_npu, on_host, served)
        self.policy.admitted(hashes, on_npu, on_host)

    def promotion_candidate(self, block_hash: BlockHash) -> None:
        """A block on the NPU tier reached the promotion threshold (or was written, at 0)."""
        self.curve.promotion_candidate(block_hash)

    def npu_evicted(self, block_hash: BlockHash, num_hits: int, kept: bool) -> None:
        """The NPU tier evicted a cached block; ``kept``: it has a host copy now."""
        self.curve.npu_evicted(block_hash, num_hits, kept)
        self.policy.npu_evicted(block_hash, num_hits, kept)

    def host_evicted(self, block_hash: BlockHash) -> None:
        self.curve.host_evicted(block_hash)
        self.policy.host_evicted(block_hash)

    def transfers_landed(self) -> None:
        self.curve.transfers_landed()

    def host_reset(self) -> None:
        """The host tier was emptied: so is every shadow."""
        self.curve.host_reset()
        self.policy.host_reset()

    def set_costs(self, costs: BlockCosts) -> None:
        self.policy.set_costs(costs)

    # ---- views -------------------------------------------------------------------------------
    def snapshot(self, block_size: int) -> RetentionStats:
        curve = self.curve
        return RetentionStats(
            curve.scaled(curve.ghost_hits_dropped),
            curve.scaled(curve.ghost_hits_host_evicted),
            *curve.num_ghosts(),
            curve.estimated_host_hit_tokens(block_size),
            self._stores,
            self._skips,
        )

    @property
    def shadow_keys(self) -> list[ShadowKey]:
        return self.curve.shadow_keys
