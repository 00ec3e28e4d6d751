"""Routing of requests to data-parallel replicas by cached prefix and load."""

from router.config import SCORING_PROFILES, RoutingConfig
from router.load import LoadTracker
from router.policies import (
    RoundRobinPolicy,
    RouteDecision,
    RoutingPolicy,
    ScoringPolicy,
    make_policy,
)
from router.prefix_index import IndexMatch, PrefixIndex
from router.router import NoLiveReplicaError, Router
from router.stats import MATCHED_FRACTION_BUCKETS, ReplicaRoutingStats, RouterStats

__all__ = [
    "MATCHED_FRACTION_BUCKETS",
    "SCORING_PROFILES",
    "IndexMatch",
    "LoadTracker",
    "NoLiveReplicaError",
    "PrefixIndex",
    "ReplicaRoutingStats",
    "RoundRobinPolicy",
    "RouteDecision",
    "Router",
    "RouterStats",
    "RoutingConfig",
    "RoutingPolicy",
    "ScoringPolicy",
    "make_policy",
]
