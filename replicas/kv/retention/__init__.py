"""Host retention: what the host tier keeps, and what it would keep with more memory or
write-back.

    policy.py    the ``RetentionPolicy`` protocol, ``BlockCosts`` and the registry of policies
    fixed.py     ``fixed``: write-through promotion and write-back as configured
    adaptive.py  ``adaptive``: stores at NPU eviction what the observed reuse pays for
    curve.py     ghost records and shadow host tiers: the miss-ratio curve, on a hash sample
    tracker.py   ``RetentionTracker``: one cache type's policy and curve, fed by the manager
    hint.py      the tuning hint the engine logs

A new policy is one file with its class and a ``register_policy`` call, imported below (or, for
a policy outside the package, before the manager is built).
"""

from replicas.kv.retention import adaptive, fixed  # noqa: F401 (registers the policies)
from replicas.kv.retention.adaptive import ADAPTIVE, HORIZON_FACTOR, AdaptivePolicy
from replicas.kv.retention.curve import (
    CAPACITY_FACTORS,
    GHOST_FACTOR,
    MAX_SHADOW_BLOCKS,
    MissRatioCurve,
    ShadowKey,
)
from replicas.kv.retention.fixed import OFF, ON, FixedPolicy
from replicas.kv.retention.hint import estimated_hit_rates, tuning_hint
from replicas.kv.retention.policy import (
    DEFAULT_COSTS,
    IMMEDIATE,
    BlockCosts,
    PolicyContext,
    PolicyFactory,
    RetentionPolicy,
    WriteThrough,
    hit_threshold,
    is_promoted,
    make_policy,
    policy_names,
    register_policy,
)
from replicas.kv.retention.tracker import RetentionStats, RetentionTracker

__all__ = [
    "ADAPTIVE",
    "CAPACITY_FACTORS",
    "DEFAULT_COSTS",
    "GHOST_FACTOR",
    "HORIZON_FACTOR",
    "IMMEDIATE",
    "MAX_SHADOW_BLOCKS",
    "OFF",
    "ON",
    "AdaptivePolicy",
    "BlockCosts",
    "FixedPolicy",
    "MissRatioCurve",
    "PolicyContext",
    "PolicyFactory",
    "RetentionPolicy",
    "RetentionStats",
    "RetentionTracker",
    "ShadowKey",
    "WriteThrough",
    "estimated_hit_rates",
    "hit_threshold",
    "is_promoted",
    "make_policy",
    "policy_names",
    "register_policy",
    "tuning_hint",
]
