"""Per-replica routing counters, read by the metrics exporter (DESIGN section 8)."""

from bisect import bisect_left
from dataclasses import dataclass, field

from replicas.kv.events import Tier, tier_count, tiers

MATCHED_FRACTION_BUCKETS: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
"""Upper bounds (``le``) of the matched-fraction histogram buckets."""


@dataclass(frozen=True, slots=True)
class ReplicaRoutingStats:
    """One replica as the router sees it, at one instant.

    ``matched_fraction_bucket_counts[k]`` counts decisions whose matched fraction (matched prompt
    tokens in any tier / prompt tokens) is at most ``MATCHED_FRACTION_BUCKETS[k]``: cumulative,
    as a Prometheus histogram wants it, so the last bucket equals ``matched_fraction_count``.
    The ``*_by_tier`` counts are per-tier tuples (``replicas.kv.events.tiers()`` order).
    """

    replica_index: int
    is_live: bool
    needs_resync: bool
    num_requests_routed: int
    num_matched_tokens: int
    num_matched_tokens_by_tier: tuple[int, ...]
    matched_fraction_sum: float
    matched_fraction_count: int
    matched_fraction_bucket_counts: tuple[int, ...]
    load_tokens: int
    num_indexed_blocks_by_tier: tuple[int, ...]  # disk: written by the replica to its node's disk
    num_event_gaps: int
    num_resyncs: int
    num_key_affinity_routes: int = 0  # decisions that followed the request's prompt_cache_key
    num_peer_sources: int = 0  # decisions naming another replica to pull the prefix from
    num_peer_priced_out: int = 0  # decisions where a source held more but the pull cost more
    num_overload_diversions: int = 0  # decisions while a replica caching more was overloaded
    peer_break_even_blocks: float | None = None  # router.peer_sources; None: not reported
    queued_tokens: int = 0  # uncached prompt tokens of its requests not past prefill
    num_requests: int = 0  # requests routed there and not released
    role: str = "serving"  # router.router.ReplicaRole: joining, serving, draining

    def num_matched_tokens_in(self, tier: Tier) -> int:
        return tier_count(self.num_matched_tokens_by_tier, tier)

    def num_indexed_blocks_in(self, tier: Tier) -> int:
        return tier_count(self.num_indexed_blocks_by_tier, tier)


@dataclass(frozen=True, slots=True)
class RouterStats:
    """Every replica's routing counters, in replica-index order; replicas retired by a
    scale-in are left out (an entry's ``replica_index`` says whose it is)."""

    replicas: tuple[ReplicaRoutingStats, ...]
    num_indexed_hashes: int
    """Distinct block hashes held by at least one replica."""


@dataclass(slots=True)
class RoutingCounters:
    """Monotonic counters of one replica, owned and updated by ``Router``.

    They survive death and rejoin (counters never go down); only the index and load are cleared.
    """

    num_requests_routed: int = 0
    num_matched_tokens: int = 0
    num_matched_tokens_by_tier: list[int] = field(default_factory=lambda: [0] * len(tiers()))
    matched_fraction_sum: float = 0.0
    num_event_gaps: int = 0
    num_resyncs: int = 0
    num_key_affinity_routes: int = 0
    num_peer_sources: int = 0
    num_peer_priced_out: int = 0
    num_overload_diversions: int = 0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(MATCHED_FRACTION_BUCKETS))
    """Decisions per matched-fraction bucket, not cumulative: ``bucket_counts[k]`` counts
    fractions in ``(MATCHED_FRACTION_BUCKETS[k - 1], MATCHED_FRACTION_BUCKETS[k]]``."""

    def record_route(
        self, num_matched_tokens_by_tier: tuple[int, ...], num_prompt_tokens: int
    ) -> None:
        """Count one decision for this replica (mutates): its matched tokens per tier."""
        num_matched_tokens = sum(num_matched_tokens_by_tier)
        fraction = num_matched_tokens / num_prompt_tokens if num_prompt_tokens > 0 else 0.0
        self.num_requests_routed += 1
        self.num_matched_tokens += num_matched_tokens
        by_tier = self.num_matched_tokens_by_tier
        by_tier += [0] * (len(num_matched_tokens_by_tier) - len(by_tier))  # a tier registered since
        for i, num_tokens in enumerate(num_matched_tokens_by_tier):
            by_tier[i] += num_tokens
        self.matched_fraction_sum += fraction
        self.bucket_counts[bisect_left(MATCHED_FRACTION_BUCKETS, fraction)] += 1

    def cumulative_bucket_counts(self) -> tuple[int, ...]:
        total = 0
        cumulative = []
        for count in self.bucket_counts:
            total += count
            cumulative.append(total)
        return tuple(cumulative)
