"""Tenant quotas: a tenant holding more than its share of a tier has its own blocks evicted
first, so a flooding tenant cannot evict another's prefix; shared-prefix blocks belong to no
tenant; quotas are checked at start-up."""

import random

import pytest
from pydantic import ValidationError

from cluster.backend import ClusterStats, ReplicaStats
from cluster.metrics import StrataMetrics
from replicas.config import EngineConfig, KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.block_pool import BlockPool
from replicas.kv.events import Tier
from replicas.kv.tenants import label
from replicas.sampling_params import SamplingParams
from tests.unit import engine_runs
from tests.unit.api.test_metrics import samples
from tests.unit.test_priority_classes import disk_offload

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
rng = random.Random(4)
SYSTEM = [rng.randrange(256) for _ in range(16 * 2)]  # shared by both tenants: 2 blocks
SESSION = SYSTEM + [rng.randrange(256) for _ in range(16 * 4 + 5)]
DOCS = [SYSTEM + [rng.randrange(256) for _ in range(16 * 4 + 3)] for _ in range(12)]


def test_an_over_quota_tenants_blocks_are_evicted_first_least_recent_first():
    pool = BlockPool(6)
    ids, _ = pool.allocate(6)
    tenants = [2, 3, 3, 2, 3, 0]  # 0: no tenant (a shared prefix)
    for i, (block_id, tenant) in enumerate(zip(ids, tenants)):
        pool.cache(block_id, bytes([i]) * 16, tenant)
    pool.free(ids)
    assert pool.eviction_order() == ids  # no quota: one LRU
    pool.quotas.set({3: 2})  # tenant 3 holds 3 blocks, one over
    assert pool.eviction_order() == [ids[1], ids[2], ids[4], ids[0], ids[3], ids[5]]
    (taken,), _ = pool.allocate(1)
    assert taken == ids[1] and pool.quotas.held == {2: 2, 3: 2} and not pool.quotas.over
    assert pool.eviction_order() == [ids[0], ids[2], ids[3], ids[4], ids[5]]  # within: LRU
    pool.check_integrity()


def engine(host: bool = False, offload: KVOffloadConfig | None = None, **prefix) -> Engine:
    """24 NPU blocks; with ``host``, as many host blocks taking every block NPU evicts (or the
    tiers ``offload`` names)."""
    if offload is None:
        offload = KVOffloadConfig(
            enabled=host, host_memory_ratio=1.0 if host else 0.0, write_back=host
        )
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=24,
            scheduler_config=SchedulerConfig(
                prefix_cache_config=PrefixCacheConfig(**prefix), kv_offload_config=offload
            ),
        )
    )


def run(replica: Engine, prompt, request_id: str, salt: str):
    return engine_runs.run(replica, prompt, request_id, PARAMS, salt)


def flood(replica: Engine):
    first = run(replica, SESSION, "s0", "app")
    for i, doc in enumerate(DOCS):
        run(replica, doc, f"doc{i}", "crawler")
    return first, run(replica, SESSION, "s1", "app")


@pytest.mark.parametrize("tier", [Tier.NPU, Tier.HOST])  # the quota tier: host, else NPU
def test_a_flooding_tenant_over_its_quota_evicts_its_own_blocks_not_anothers(tier):
    host = tier is Tier.HOST
    first, lru = flood(engine(host, shared_prefixes=[SYSTEM]))
    assert lru.num_cached_tokens < 6 * 16  # one LRU: the crawl evicted the session
    replica = engine(host, shared_prefixes=[SYSTEM], tenant_quotas={"crawler": 0.25})
    first, turn = flood(replica)
    assert turn.token_ids == first.token_ids == lru.token_ids
    assert turn.num_cached_tokens == 6 * 16 and turn.num_cached_tokens_in(tier) >= 4 * 16
    pool = replica.kv_cache.host if host else replica.kv_cache.npu
    crawler, app = (replica.kv_cache.tenants.index(s) for s in ("crawler", "app"))
    # Soft quotas: the crawler holds what nobody else needs; the shared 2 blocks are no one's.
    assert pool.quotas.held[app] == 4 and pool.quotas.held[crawler] > 6


@pytest.mark.parametrize("quotas", [{"a": 0.0}, {"a": 1.5}, {"a": 0.6, "b": 0.6}])
def test_bad_quotas_fail_at_start_naming_the_option(quotas):
    with pytest.raises(ValidationError, match="tenant_quotas"):
        PrefixCacheConfig(tenant_quotas=quotas)


def test_tenants_are_exported_by_name_when_the_config_names_them_else_by_digest():
    replica = engine(shared_prefixes=[SYSTEM], tenant_quotas={"crawler": 0.25})
    flood(replica)
    stats = replica.stats()
    got = samples(StrataMetrics().render(ClusterStats([ReplicaStats(0, True, stats)])).decode())
    app = label(2, "app", ())
    assert app.startswith("salt-") and "app" not in app
    key = frozenset({"replica": "0", "tenant": app}.items())
    prompt_tokens = 2 * len(SESSION)
    assert got[("strata_kv_tenant_queries_total", key)] == prompt_tokens
    assert got[("strata_kv_tenant_hits_total", key)] == 6 * 16  # its second turn, all of it
    crawler = frozenset({"replica": "0", "tenant": "crawler", "tier": "npu"}.items())
    assert got[("strata_kv_tenant_quota_blocks", crawler)] == 6  # no host tier: on NPU
    assert got[("strata_kv_tenant_blocks", crawler)] == stats.tenants["crawler"].blocks["npu"]


@pytest.mark.parametrize("quotas", [None, {"crawler": 0.25}])
def test_a_flooding_tenant_over_its_disk_quota_replaces_its_own_disk_blocks(tmp_path, quotas):
    """The session's blocks on disk alone; the crawl's pass through 24 disk slots. Under one
    LRU they replace the session's; over its quota of 6 slots, the crawler's own."""
    replica = engine(offload=disk_offload(tmp_path / str(bool(quotas))), shared_prefixes=[SYSTEM])
    if quotas:
        replica.kv_cache.set_tenant_quotas(quotas, 0.05)
    first = run(replica, SESSION, "s0", "app")
    for _ in range(2):  # host stores land, then their disk stores are handed over
        replica.core.flush_transfers(wait=True)
    replica.reset_prefix_cache("npu")
    replica.reset_prefix_cache("host")
    for i, doc in enumerate(DOCS):
        run(replica, doc, f"doc{i}", "crawler")
    disk = replica.backing["disk"]["full"]
    assert disk.stats().evictions > 0
    replica.reset_prefix_cache("npu")
    replica.reset_prefix_cache("host")
    turn = run(replica, SESSION, "s1", "app")
    assert turn.token_ids == first.token_ids
    crawler = replica.kv_cache.tenants.index("crawler")
    if quotas:  # read back from disk: the session's own 4 blocks and the shared 2
        assert turn.num_cached_tokens == 6 * 16
        assert disk.tenants.quotas.quota == {crawler: 6}
        exported = replica.stats().tenants.values()  # by digest: the config names no tenant
        assert any(s.quota_blocks.get("disk") == 6 for s in exported)
    else:
        assert turn.num_cached_tokens < 6 * 16  # the case the quota fixes
    replica.close()


SESSIONS = [SYSTEM + [rng.randrange(256) for _ in range(16 * 4 + 5)] for _ in range(10)]
MORE_DOCS = [SYSTEM + [rng.randrange(256) for _ in range(16 * 4 + 3)] for _ in range(30)]


@pytest.mark.parametrize("quotas", [None, "auto"])
def test_auto_quotas_size_the_disk_from_a_curve_of_its_own(tmp_path, quotas):
    """Ten sessions of 4 blocks each seen twice: a reuse distance of about 40 blocks, past the
    24 host blocks (no host quota can hold them) but within the 96 disk slots. ``auto`` samples
    a curve at the disk's own size beside the host's, so the sessions get a disk quota that
    holds them and the crawl (120 blocks, each seen once) replaces its own disk blocks; under
    one LRU it replaces theirs."""
    offload = disk_offload(tmp_path).model_copy(update={"disk_bytes": 96 * 4 * 2 * 16 * 2 * 64 * 4})
    replica = engine(offload=offload, shared_prefixes=[SYSTEM])
    kv = replica.kv_cache
    if quotas:
        kv.set_tenant_quotas(quotas, 0.05)
        assert (kv.disk_quotas.capacity, kv.auto_quotas.capacity) == (96, 24)
    firsts = [run(replica, p, f"s{i}", "app") for i, p in enumerate(SESSIONS)]
    for i, prompt in enumerate(SESSIONS):
        run(replica, prompt, f"again{i}", "app")
        replica.core.flush_transfers(wait=True)
    for i, doc in enumerate(MORE_DOCS):
        run(replica, doc, f"doc{i}", "crawler")
    replica.core.flush_transfers(wait=True)
    disk = replica.backing["disk"]["full"]
    assert disk.stats().evictions > 0
    replica.reset_prefix_cache("npu")
    replica.reset_prefix_cache("host")
    turns = [run(replica, p, f"t{i}", "app") for i, p in enumerate(SESSIONS)]
    assert [t.token_ids for t in turns] == [f.token_ids for f in firsts]
    cached = sum(t.num_cached_tokens for t in turns)
    if quotas:
        app, crawler = (kv.tenants.index(t) for t in ("app", "crawler"))
        assert disk.tenants.quotas.quota[app] >= 40 > kv.auto_quotas.quota.get(app, 0)
        assert disk.tenants.quotas.quota[crawler] < 8
        assert cached == 10 * 6 * 16  # every session's 4 blocks and the shared 2, from disk
    else:
        assert cached < 10 * 3 * 16  # the case the disk's own curve fixes
    replica.close()
