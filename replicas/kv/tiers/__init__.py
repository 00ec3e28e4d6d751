"""KV cache tiers as plugins: the interface a tier implements (``base``), the registry from
name to plugin (``registry``) and the built-in tiers, ``npu``, ``host`` and ``disk``."""

from replicas.kv.tiers.base import BackingStore, HandoverStore, TierLevel, TierStore, order_tiers
from replicas.kv.tiers.registry import (
    BackingOptions,
    TierContext,
    TierPlugin,
    names_registered,
    parse_options,
    plugin,
    register,
)

__all__ = [
    "BackingOptions",
    "BackingStore",
    "HandoverStore",
    "TierContext",
    "TierLevel",
    "TierPlugin",
    "TierStore",
    "names_registered",
    "order_tiers",
    "parse_options",
    "plugin",
    "register",
]
