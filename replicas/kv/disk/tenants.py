"""The own slab's blocks per tenant (``replicas.kv.tenants``) and their quotas there.

A block stored to disk from a host block keeps the host block's tenant (its ``cache_salt``'s
index on this replica), as it keeps its batch class; fixed shares of the quota tier (host)
apply to the own slab's slots alike, and ``auto`` shares are sized for the slab from curves
sampled at its own size (``KVCacheManager.disk_quotas``). Quotas are soft, as in the pooled
tiers: a tenant holds more while slots are free, but once the slab is full and a tenant holds
more than its quota, its least recently used block is replaced first, before any block of a
tenant within its quota (after the batch blocks, which go before everything). Tenants live in
memory only: after a restart every block belongs to no tenant.
"""

from collections import OrderedDict
from collections.abc import Collection, Mapping

from replicas.kv.hashing import BlockHash
from replicas.kv.tenants import NO_TENANT, TenantQuotas


class SlotTenants:
    """Each own block's tenant, each tenant's blocks least recently used first, and the quotas
    (``TenantQuotas``) in slots."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.quotas = TenantQuotas()
        self._tenant: dict[BlockHash, int] = {}
        self._lru: dict[int, OrderedDict[BlockHash, None]] = {}

    def held(self, key: BlockHash, tenant: int) -> None:
        """A new own block of ``tenant`` (``NO_TENANT``: nobody's, not tracked)."""
        if tenant == NO_TENANT:
            return
        self._tenant[key] = tenant
        self._lru.setdefault(tenant, OrderedDict())[key] = None
        self.quotas.cached(tenant)

    def used(self, key: BlockHash) -> None:
        """An own block became the most recently used."""
        tenant = self._tenant.get(key)
        if tenant is not None:
            self._lru[tenant].move_to_end(key)

    def dropped(self, key: BlockHash) -> None:
        """An own block left the slab."""
        tenant = self._tenant.pop(key, None)
        if tenant is not None:
            del self._lru[tenant][key]
            self.quotas.uncached(tenant)

    def clear(self) -> None:
        for key in list(self._tenant):
            self.dropped(key)

    def set_shares(self, shares: Mapping[int, float]) -> None:
        """Each tenant's share of the slab's slots as its quota (replacing every earlier one;
        ``NO_TENANT``'s, the shared pool's, is none)."""
        self.quotas.set({t: int(share * self.num_slots) for t, share in shares.items()})

    def evictee(self, retained: Collection[BlockHash]) -> BlockHash | None:
        """The least recently used block, not ``retained``, of the first tenant over its
        quota; None when no tenant over its quota has one."""
        for tenant in self.quotas.over:
            key = next((k for k in self._lru[tenant] if k not in retained), None)
            if key is not None:
                return key
        return None
