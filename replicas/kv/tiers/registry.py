"""The tier registry: from a tier's name to its plugin (traits, options, factory).

A tier is one file that builds a ``TierPlugin`` named ``PLUGIN``, plus its entry in
``BUILT_IN`` (name -> module), which imports and registers it the first time the name is looked
up (``plugin``)::

    BUILT_IN = {"npu": ..., "disk": "replicas.kv.tiers.disk", ..., "<name>": "<module>"}

Code outside the registry may register more at run time (``register``: a test, an extension
imported before the engine starts). Everything tier-specific is derived from the registered
plugins: the transfer plan's copy paths (``replicas.kv.records.copy_path``), the config's
backing tiers and their options (``KVOffloadConfig.tiers``), their capacity (the byte budget
each takes), the router's weights and the metrics' tier labels (``TierTraits``).
"""

import importlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from replicas.kv.events import Tier, TierTraits, register_tier, tiers
from replicas.kv.tiers.base import BackingStore

BUILT_IN: dict[str, str] = {
    "npu": "replicas.kv.tiers.npu",
    "host": "replicas.kv.tiers.host",
    "disk": "replicas.kv.tiers.disk",
    "peer": "replicas.kv.tiers.peer",
}
"""The tiers Strata ships, by name: the module whose import registers each."""


class BackingOptions(BaseModel):
    """The options every backing tier takes in ``kv_offload_config.tiers``; a tier's own
    options model extends it."""

    model_config = ConfigDict(extra="forbid")

    bytes: int | None = Field(
        None,
        gt=0,
        description="The tier's KV budget in bytes for the whole deployment, divided equally "
        "among the replicas (a tier that is written to needs one).",
    )


class TierContext(NamedTuple):
    """What a backing tier's factory builds one replica's stores from."""

    fingerprint: str  # the model's weights, architecture, KV format and block size, digested
    block_shapes: Mapping[str, tuple[int, ...]]  # per cache type: one block's tensor shape
    dtypes: Mapping[str, torch.dtype]  # per cache type: its KV tensor dtype
    num_blocks: Mapping[str, int]  # per cache type: the replica's share of the byte budget
    retained_share: float  # kv_offload_config.retained_share
    retained_priority: str = "decay"  # kv_offload_config.retained_priority


class TierPlugin(NamedTuple):
    """One tier: its traits, and for a backing tier its options model and the factory that
    opens one replica's store per cache type."""

    traits: TierTraits
    options: type[BackingOptions] = BackingOptions
    open: Callable[[TierContext, Any], dict[str, BackingStore]] | None = None
    writable: bool = True
    """Whether host blocks are written to the tier (by the host tier's rules, with a byte
    budget); a tier that is only read (another replica's blocks: ``peer``) takes no budget."""


_PLUGINS: dict[str, TierPlugin] = {}


def register(plugin: TierPlugin) -> Tier:
    """Register a tier (its name among ``replicas.kv.events.tiers()`` too); registering the
    same plugin again is a no-op."""
    existing = _PLUGINS.get(plugin.traits.name)
    if existing is not None and existing != plugin:
        raise ValueError(f"KV tier {plugin.traits.name!r} is registered already")
    if not plugin.traits.pooled and plugin.open is None:
        raise ValueError(f"backing tier {plugin.traits.name!r} needs a factory (open)")
    tier = register_tier(plugin.traits)
    _PLUGINS[plugin.traits.name] = plugin
    return tier


def plugin(name: str) -> TierPlugin:
    """The plugin registered under ``name`` (a built-in is imported on first use); raises
    ``ValueError`` naming the registered tiers for any other name."""
    found = _PLUGINS.get(name)
    if found is None and name in BUILT_IN:
        register(importlib.import_module(BUILT_IN[name]).PLUGIN)  # imported once; registered
        found = _PLUGINS.get(name)
    if found is None:
        names = ", ".join(repr(n) for n in names_registered())
        raise ValueError(f"unknown KV tier {name!r}; the registered tiers are {names}")
    return found


def names_registered() -> list[str]:
    """Every tier's name: the built-in ones and those registered since, nearest first."""
    return list(dict.fromkeys([*(str(t) for t in tiers()), *BUILT_IN, *_PLUGINS]))


def parse_options(name: str, options: Mapping[str, Any]) -> BackingOptions:
    """A backing tier's options, validated by its plugin (``ValueError`` naming the tier)."""
    try:
        found = plugin(name)
    except ValueError as error:
        raise ValueError(f"kv_offload_config.tiers: {error}") from None
    if found.traits.pooled:
        raise ValueError(
            f"kv_offload_config.tiers names {name!r}, which is not a tier behind host; the "
            "NPU and host tiers are configured by their own options"
        )
    try:
        parsed = found.options.model_validate(dict(options))
    except ValidationError as error:  # restated in one sentence, with the option's path
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(
            f"kv_offload_config.tiers[{name!r}].{where}: {first['msg']} (got {first['input']!r})"
        ) from None
    if found.writable and parsed.bytes is None:
        raise ValueError(
            f"kv_offload_config.tiers[{name!r}].bytes is required: the tier's budget in bytes "
            "for the whole deployment"
        )
    return parsed
