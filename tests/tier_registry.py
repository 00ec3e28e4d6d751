"""Putting the KV tier registry back as it was: registration is process-global (names in
``replicas.kv.events``, plugins in ``replicas.kv.tiers.registry``), and most tests count the
built-in tiers only (per-tier tuples of three). A test that registers a tier, or validates a
config naming one, restores the registry when it ends."""

import contextlib
from collections.abc import Iterator

import replicas.kv.events as events
from replicas.kv.tiers import registry

_STATE = ((events, ("_BY_NAME", "_TRAITS", "_ORDER", "_TIER_INDEX")), (registry, ("_PLUGINS",)))


@contextlib.contextmanager
def restored_tier_registry() -> Iterator[None]:
    saved = [
        (module, name, type(getattr(module, name))(getattr(module, name)))
        for module, names in _STATE
        for name in names
    ]
    try:
        yield
    finally:
        for module, name, value in saved:
            current = getattr(module, name)
            current.clear()
            (current.extend if isinstance(current, list) else current.update)(value)
