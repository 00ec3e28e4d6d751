"""Prometheus metric families of the router (``strata_router_*``, label ``replica``; DESIGN
section 8), from the ``RouterStats`` a stats snapshot carries (``ClusterStats.router``).
``cluster.metrics`` renders them with the deployment's other families."""

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from replicas.kv.events import Tier, tiers
from router.stats import MATCHED_FRACTION_BUCKETS, ReplicaRoutingStats, RouterStats

_PER_REPLICA_COUNTERS = (
    ("strata_router_requests", "Requests the router sent to the replica.", "num_requests_routed"),
    ("strata_router_event_gaps", "KV event sequence gaps seen.", "num_event_gaps"),
    ("strata_router_resyncs", "Index rebuilds from a snapshot.", "num_resyncs"),
    (
        "strata_router_key_affinity",
        "Requests sent to the replica because it served their prompt_cache_key last.",
        "num_key_affinity_routes",
    ),
    (
        "strata_router_peer_sources",
        "Requests sent to the replica with another replica named to pull their prefix from "
        "(a pull that beats recompute, at least routing.peer_pull_min_blocks blocks).",
        "num_peer_sources",
    ),
    (
        "strata_router_peer_priced_out",
        "Requests sent to the replica while another held more of their prefix, computed "
        "there because pulling it would cost more (router.peer_sources).",
        "num_peer_priced_out",
    ),
    (
        "strata_router_overload_diversions",
        "Requests sent to the replica while another cached more of their prompt but carried "
        "more than routing.overload_factor times the least loaded replica's active tokens.",
        "num_overload_diversions",
    ),
)
"""(name, help, ``ReplicaRoutingStats`` field) of the counters that are one field per replica."""


def router_metric_families(router_stats: RouterStats | None) -> list[Metric]:
    """Routing decisions, matched fractions, load and index size per replica, from
    ``ClusterStats.router``; empty while no router is deployed (``None``)."""
    if router_stats is None:
        return []
    counters = {
        field: CounterMetricFamily(name, text, labels=["replica"])
        for name, text, field in _PER_REPLICA_COUNTERS
    }
    matched = CounterMetricFamily(
        "strata_router_matched_tokens",
        "Prompt tokens the router's index matched on the chosen replica, by tier.",
        labels=["replica", "tier"],
    )
    fraction = HistogramMetricFamily(
        "strata_router_matched_fraction",
        "Matched prompt tokens / prompt tokens of each routing decision.",
        labels=["replica"],
    )
    load = GaugeMetricFamily(
        "strata_router_load_tokens",
        "Active context tokens charged to the replica.",
        labels=["replica"],
    )
    live = GaugeMetricFamily("strata_router_replica_live", "1 while routed to.", labels=["replica"])
    indexed = GaugeMetricFamily(
        "strata_router_indexed_blocks",
        "Blocks of the replica in the router's prefix index.",
        labels=["replica", "tier"],
    )
    break_even = GaugeMetricFamily(
        "strata_router_peer_break_even_blocks",
        "The fewest missing prompt blocks the replica pulls from an idle peer rather than "
        "computes, from its reported costs (+Inf: none).",
        labels=["replica"],
    )
    for replica in router_stats.replicas:
        label = str(replica.replica_index)
        if replica.peer_break_even_blocks is not None:
            break_even.add_metric([label], replica.peer_break_even_blocks)
        for field, family in counters.items():
            family.add_metric([label], getattr(replica, field))
        num_npu_matched = replica.num_matched_tokens_in(Tier.NPU)
        matched.add_metric([label, Tier.NPU], num_npu_matched)
        # The host series counts every matched token past the NPU: a backing tier's blocks
        # (disk's, any registered one's) reach the NPU through host.
        matched.add_metric([label, Tier.HOST], replica.num_matched_tokens - num_npu_matched)
        fraction.add_metric([label], _fraction_buckets(replica), replica.matched_fraction_sum)
        load.add_metric([label], replica.load_tokens)
        live.add_metric([label], 1.0 if replica.is_live else 0.0)
        for tier, num_blocks in zip(tiers(), replica.num_indexed_blocks_by_tier):
            if num_blocks or tier.traits.pooled:  # a backing tier's once it has blocks
                indexed.add_metric([label, tier], num_blocks)
    routed, *rest = counters.values()
    return [routed, matched, fraction, load, live, indexed, break_even, *rest]


def _fraction_buckets(replica: ReplicaRoutingStats) -> list[tuple[str, int]]:
    """The cumulative buckets of a replica's matched-fraction histogram, ``+Inf`` last."""
    buckets = [
        (str(bound), count)
        for bound, count in zip(MATCHED_FRACTION_BUCKETS, replica.matched_fraction_bucket_counts)
    ]
    return [*buckets, ("+Inf", replica.matched_fraction_count)]
