"""Per-tenant metrics of each replica's prefix cache (``replicas.kv.tenants``): label
``tenant`` is ``none`` (no salt, shared prefixes), ``other`` (past the tenants tracked), a salt
the config names, or a digest of the salt (salts are secrets)."""

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.backend import ReplicaStats


def tenant_metric_families(replicas: list[ReplicaStats]) -> list[Metric]:
    by_tenant = ["replica", "tenant"]
    queries = CounterMetricFamily(
        "strata_kv_tenant_queries", "Prompt tokens looked up, by tenant.", labels=by_tenant
    )
    hits = CounterMetricFamily(
        "strata_kv_tenant_hits", "Prompt tokens served from the cache, by tenant.", labels=by_tenant
    )
    blocks = GaugeMetricFamily(
        "strata_kv_tenant_blocks",
        "Cached blocks a tenant holds, by pooled tier (the primary cache type's).",
        labels=[*by_tenant, "tier"],
    )
    quota = GaugeMetricFamily(
        "strata_kv_tenant_quota_blocks",
        "Blocks a tenant may hold before its blocks are evicted first, by tier.",
        labels=[*by_tenant, "tier"],
    )
    for replica in replicas:
        if replica.engine is None:
            continue
        label = str(replica.replica_index)
        for tenant, stats in replica.engine.tenants.items():
            queries.add_metric([label, tenant], stats.queries)
            hits.add_metric([label, tenant], stats.hits)
            for tier, value in stats.blocks.items():
                blocks.add_metric([label, tenant, tier], value)
            for tier, value in stats.quota_blocks.items():
                quota.add_metric([label, tenant, tier], value)
    return [queries, hits, blocks, quota]
