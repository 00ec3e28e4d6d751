"""A request's prompt-cache hints: where to route it, and which prefix to keep for how long.

The HTTP API reads them from OpenAI's fields (``prompt_cache_key``, ``prompt_cache_options``,
``prompt_cache_retention`` and a text part's ``prompt_cache_breakpoint``) and they travel with
the request: the router reads ``key`` (requests sharing a key stay on one replica while it is not
overloaded), the replica's KV cache reads ``retain_tokens`` and ``ttl_s`` (the prompt's first
``retain_tokens`` tokens, in whole blocks, are kept ahead of ordinary blocks in the host and disk
tiers until ``ttl_s`` seconds after the request was admitted, a lifetime the engine bounds by
the session's learned one, ``bounded``; DESIGN section 4, "Retention"), and ``peer`` (another
replica holding a longer prefix, which the replica pulls it from).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

RETENTION_TTLS_S: dict[str, float] = {
    "5m": 300.0,
    "30m": 1800.0,
    "1h": 3600.0,
    "12h": 43200.0,
    "24h": 86400.0,
}
"""The lifetimes Strata offers, by the strings the API accepts; the longest is 24 hours."""

DEFAULT_TTL = "30m"
"""The lifetime of a breakpoint whose request names none (OpenAI's default)."""


def parse_ttl(value: str, field: str) -> float:
    """Seconds of an offered lifetime; raises ``ValueError`` naming ``field`` otherwise."""
    seconds = RETENTION_TTLS_S.get(value) if isinstance(value, str) else None
    if seconds is None:
        offered = ", ".join(RETENTION_TTLS_S)
        raise ValueError(f"{field} {value!r} is not a lifetime this server offers ({offered})")
    return seconds


SERVICE_TIERS: dict[str, bool] = {
    "flex": True,
    "auto": False,
    "default": False,
    "scale": False,
    "priority": False,
}
"""OpenAI's ``service_tier`` values, by whether they make a request batch."""


def parse_service_tier(value: str | None) -> bool | None:
    """Whether a ``service_tier`` is batch (None when unset); ``ValueError`` naming the field
    otherwise."""
    if value is None:
        return None
    if value not in SERVICE_TIERS:
        raise ValueError(f"service_tier {value!r} is not one of {', '.join(SERVICE_TIERS)}")
    return SERVICE_TIERS[value]


class PeerSource(NamedTuple):
    """Another replica of the deployment that holds a longer prefix of the prompt than the one
    serving it (named by the router, ``replicas.kv.tiers.peer``): its index, its handle (an
    actor handle, or an in-process ``replicas.kv.tiers.peer.LocalPeer``) and how many leading
    prompt tokens it holds (whole blocks count)."""

    replica_index: int
    handle: Any
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CacheHints:
    """What a request asks of the prefix cache beyond plain reuse (all optional)."""

    key: str | None = None
    """``prompt_cache_key``: requests with one key go to one replica while it is not
    overloaded."""
    retain_tokens: int = 0
    """Leading prompt tokens to keep for ``ttl_s`` (only whole blocks count)."""
    ttl_s: float = 0.0
    """Seconds the retained prefix outlives ordinary blocks, from the request's admission."""
    batch: bool | None = None
    """The request's priority class: batch (OpenAI's ``service_tier: flex``) or interactive;
    None: its tenant's default (``PrefixCacheConfig.batch_tenants``). Batch blocks are evicted
    before interactive ones (``replicas.kv.block_pool``)."""
    peer: PeerSource | None = None
    """A replica to pull the prompt's prefix from, instead of computing it again (the router
    names one when pulling pays; a replica without the peer tier ignores it)."""

    def __post_init__(self) -> None:
        if self.retain_tokens < 0:
            raise ValueError(f"retain_tokens must be non-negative, got {self.retain_tokens}")
        if not (math.isfinite(self.ttl_s) and 0.0 <= self.ttl_s <= max(RETENTION_TTLS_S.values())):
            raise ValueError(f"ttl_s must be in [0, 86400], got {self.ttl_s}")

    @property
    def retains(self) -> bool:
        """Whether the request asks for a prefix to be kept."""
        return self.retain_tokens > 0 and self.ttl_s > 0

    def retained_blocks(self, block_size: int, num_prompt_tokens: int) -> int:
        """Whole blocks of the prompt the request retains."""
        if not self.retains:
            return 0
        return min(self.retain_tokens, num_prompt_tokens) // block_size

    def bounded(self, max_ttl_s: float | None) -> "CacheHints":
        """These hints with the prefix kept for at most ``max_ttl_s`` (its session's learned
        lifetime, ``replicas.kv.session_gaps``: just long enough for the session's next turn);
        the same hints for None or a bound no shorter than ``ttl_s``."""
        if max_ttl_s is None or max_ttl_s >= self.ttl_s:
            return self
        return dataclasses.replace(self, ttl_s=max_ttl_s)
