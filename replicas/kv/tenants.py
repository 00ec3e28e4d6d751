"""Tenants of one replica's prefix cache, and their quotas in each pooled tier.

A tenant is a ``cache_salt``: its blocks hash apart from every other tenant's
(``replicas.kv.hashing``), so each cached block has one owner, named at caching time
(``BlockPool.cache``); a request without a salt, and the blocks of a shared prefix
(``replicas.kv.shared_prefixes``), belong to no tenant (``NO_TENANT``: the shared pool). The
first ``MAX_TENANTS`` salts seen get a tenant each; later ones share ``OTHER``.

A quota is a share of the quota tier's blocks (host, else NPU: ``quota_pools``). Quotas are
soft: a tenant may hold more while blocks are free, but once it holds more than its quota its
cached blocks are evicted first, least recently used first (``FreeBlockQueue``), before any
block of a tenant within its quota. So a tenant within its quota loses blocks only to the
ordinary LRU, never to one over it.
"""

from collections.abc import Collection, Iterable, Mapping
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from replicas.kv.block_pool import BlockPool
    from replicas.kv.cache_type import CacheType

NO_TENANT = 0
OTHER = 1
MAX_TENANTS = 64
"""Salts with a tenant of their own (then ``OTHER``): bounds every per-tenant table."""


class TenantTable:
    """Salt -> tenant index, for one replica."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self.names: list[str] = ["", "other"]  # by index

    def index(self, salt: str | None) -> int:
        if salt is None:
            return NO_TENANT
        index = self._index.get(salt)
        if index is None:
            if len(self._index) >= MAX_TENANTS:
                return OTHER
            index = self._index[salt] = len(self.names)
            self.names.append(salt)
        return index

    def known(self) -> dict[str, int]:
        return dict(self._index)


class TenantQuotas:
    """One pool's blocks held per tenant (cached, referenced or not), its quotas in blocks, and
    the tenants over their quota (read by the pool's ``FreeBlockQueue``)."""

    __slots__ = ("held", "over", "quota")

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.quota: dict[int, int] = {}
        self.over: dict[int, None] = {}  # ordered: the first over its quota is evicted first

    def cached(self, tenant: int) -> None:
        held = self.held[tenant] = self.held.get(tenant, 0) + 1
        if tenant in self.quota and held > self.quota[tenant]:
            self.over[tenant] = None

    def uncached(self, tenant: int) -> None:
        held = self.held[tenant] = self.held[tenant] - 1
        if tenant in self.over and held <= self.quota[tenant]:
            del self.over[tenant]

    def set(self, quota: Mapping[int, int]) -> None:
        """Quotas in blocks by tenant (replacing every earlier one)."""
        self.quota = {t: q for t, q in quota.items() if t != NO_TENANT}
        self.over = {t: None for t, q in self.quota.items() if self.held.get(t, 0) > q}


class TenantStats(NamedTuple):
    """One tenant's prompt tokens and cached (hit) tokens so far, and the blocks it holds and
    may hold (its quota; absent without one) per pooled tier."""

    queries: int
    hits: int
    blocks: dict[str, int]
    quota_blocks: dict[str, int]


def tenant_stats(
    table: TenantTable,
    pools: Mapping[str, "BlockPool | None"],
    counts: Mapping[int, tuple[int, int]],
    named: Collection[str],
) -> dict[str, TenantStats]:
    """Every tenant's stats by its label (``label``), the primary cache type's ``pools`` by
    tier."""
    stats = {}
    for index, salt in enumerate(table.names):
        queries, hits = counts.get(index, (0, 0))
        live = {t: p for t, p in pools.items() if p is not None}
        blocks = {t: p.quotas.held.get(index, 0) for t, p in live.items()}
        quota = {t: p.quotas.quota[index] for t, p in live.items() if index in p.quotas.quota}
        if queries or any(blocks.values()) or quota:
            stats[label(index, salt, named)] = TenantStats(queries, hits, blocks, quota)
    return stats


def label(index: int, salt: str, named: Collection[str]) -> str:
    """What a tenant is called in metrics: ``none`` (no salt, shared prefixes), ``other``, a
    salt the config names (an operator's own), else a digest of the salt (salts are secrets)."""
    if index in (NO_TENANT, OTHER):
        return ("none", "other")[index]
    if salt in named:
        return salt
    return "salt-" + blake2b(salt.encode(), digest_size=4).hexdigest()


def quota_pools(cache_types: "Iterable[CacheType]") -> list["BlockPool"]:
    """The pools quotas bind: each cache type's host pool, else its NPU pool. (The NPU tier of
    a replica with a host tier holds its running requests' blocks: a quota there would evict
    a tenant's cached blocks whenever its running requests grow, and a curve cannot tell.)"""
    return [c.host if c.host is not None else c.npu for c in cache_types]


def apply_quotas(
    cache_types: "Iterable[CacheType]",
    shares: Mapping[int, float],
    tiers: Collection[str] = ("pool", "disk"),
) -> None:
    """Each tenant's share of the quota pool of every cache type, as its quota in blocks
    (``tiers`` has ``pool``), and of the own slots of every backing store that keeps tenants
    (``disk``: ``slot_tenants``)."""
    cache_types = list(cache_types)
    if "pool" in tiers:
        for pool in quota_pools(cache_types):
            pool.quotas.set({t: int(share * pool.num_blocks) for t, share in shares.items()})
    if "disk" in tiers:
        for tenants in slot_tenants(cache_types):
            tenants.set_shares(shares)


def slot_tenants(cache_types: "Iterable[CacheType]") -> list:
    """The tenants of the own slots of every backing store that keeps them (the disk tier's
    ``tenants``: ``replicas.kv.disk.tenants.SlotTenants``)."""
    return [tenants for c in cache_types for tenants in backing_tenants(c).values()]


def backing_tenants(cache_type: "CacheType") -> dict[str, Any]:
    """A cache type's backing stores that keep tenants, their ``tenants`` by tier."""
    found = {str(level.tier): getattr(level.store, "tenants", None) for level in cache_type.backing}
    return {tier: tenants for tier, tenants in found.items() if tenants is not None}
