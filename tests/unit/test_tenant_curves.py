"""Auto quotas: each tenant's sampled reuse-distance curve, the share-out that maximises hits
over the curves, and a replica whose crawler tenant is held to what its curve earns while an
agent's working set stays cached."""

import random

import pytest

from replicas.config import EngineConfig, KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv import tenant_curves
from replicas.kv.tenant_curves import TenantCurves, share_out
from replicas.sampling_params import SamplingParams
from tests.unit import engine_runs


def blocks(*ids: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in ids]


def test_a_tenants_curve_counts_each_access_at_its_lru_reuse_distance():
    curves = TenantCurves(1.0, max_tracked=100)
    for _ in range(3):
        curves.access(7, blocks(1, 2, 3))  # a cycle of 3: hits only with 3 blocks or more
    curves.access(8, blocks(*range(50)))  # a scan: never hits
    assert curves.hits(7, 2) == 0 and curves.hits(7, 3) == curves.hits(7, 100) == 6
    assert curves.hits(8, 100) == 0 and curves.accesses == {7: 9.0, 8: 50.0}
    curves.decay()
    assert curves.hits(7, 3) == 3 and curves.active() == [7, 8]


def test_the_share_out_gives_the_working_set_what_it_needs_and_the_scan_its_minimum():
    curves = TenantCurves(1.0, max_tracked=1000)
    for _ in range(4):
        curves.access(2, blocks(*range(30)))  # a 30-block working set, reused
        curves.access(3, blocks(*range(1000 * _, 1000 * _ + 200)))  # 200 new blocks each time
    quota = share_out(curves, [2, 3], capacity=128, min_share=0.05)
    assert quota[2] >= 30 and quota[3] == int(128 * 0.05)


PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
rng = random.Random(6)
SESSION = [rng.randrange(256) for _ in range(16 * 5 + 5)]
DOCS = [[rng.randrange(256) for _ in range(16 * 5 + 3)] for _ in range(32)]


def run(replica: Engine, prompt, request_id: str, salt: str):
    return engine_runs.run(replica, prompt, request_id, PARAMS, salt)


@pytest.fixture
def resize_every_step(monkeypatch):
    monkeypatch.setattr(tenant_curves, "LOOK_EVERY", 0.0)
    monkeypatch.setattr(tenant_curves, "DECAY", 1.0)  # a resize every step: no decay


def serve(quotas) -> tuple[Engine, list]:
    """An agent's turns, four crawled documents between each two."""
    config = EngineConfig(
        model="tiny",
        num_npu_blocks=24,
        scheduler_config=SchedulerConfig(
            prefix_cache_config=PrefixCacheConfig(tenant_quotas=quotas, tenant_min_share=0.1),
            kv_offload_config=KVOffloadConfig(),
        ),
    )
    replica = Engine(config)
    turns = []
    for i in range(8):
        turns.append(run(replica, SESSION, f"s{i}", "app"))
        for j, doc in enumerate(DOCS[4 * i : 4 * i + 4]):
            run(replica, doc, f"doc{i}.{j}", "crawler")
    return replica, turns


def test_auto_quotas_keep_a_reused_working_set_cached_beside_a_crawl(resize_every_step):
    _, lru = serve({})
    assert all(t.num_cached_tokens < 5 * 16 for t in lru)  # one LRU: the crawl evicts some
    replica, turns = serve("auto")
    app, crawler = (replica.kv_cache.tenants.index(s) for s in ("app", "crawler"))
    quota = replica.kv_cache.npu.quotas.quota
    assert quota[crawler] == int(24 * 0.1) and quota[app] >= 5  # its working set: 5 blocks
    assert all(t.num_cached_tokens >= 5 * 16 for t in turns[2:])  # once its curve showed it
    assert [t.token_ids for t in turns] == [t.token_ids for t in lru]


def test_looks_come_with_traffic_and_sooner_for_a_tenant_without_a_quota():
    """The first look comes after ``NEWCOMER_LOOK`` capacities' worth of blocks looked up, not
    ``LOOK_EVERY``, and so does the one after a new tenant's first request; with every tenant
    holding a quota the longer count holds. Time plays no part."""
    quotas = tenant_curves.AutoQuotas(64, 0.1)
    soon = int(tenant_curves.NEWCOMER_LOOK * 64)
    every = int(tenant_curves.LOOK_EVERY * 64)
    quotas.observe(2, blocks(*range(4)) * (soon // 4 - 1))
    assert quotas.resize() is None  # 4 blocks short
    quotas.observe(0, blocks(*range(200, 204)))  # the shared pool's count towards a look
    assert set(quotas.resize()) == {2}
    quotas.observe(3, blocks(*range(100, 104)) * (soon // 4))  # a newcomer
    shares = quotas.resize()
    assert shares is not None and set(shares) == {2, 3}
    quotas.observe(2, blocks(*range(4)) * (soon // 4))
    assert quotas.resize() is None  # every tenant has its quota: the longer count holds
    quotas.observe(2, blocks(*range(4)) * ((every - soon) // 4 - 1))
    assert quotas.resize() is None and quotas._looked_up == every - 4
    quotas.observe(3, blocks(*range(100, 104)))
    quotas.resize()
    assert quotas._looked_up == 0  # looked


def test_the_run_long_prediction_counts_first_accesses_which_the_decayed_one_forgets():
    """A tenant that asks 3 prompts of 4 blocks again and again: its curve over the run counts
    each block's first access as a miss at any quota (12 of 48 accesses), while the recent,
    decayed curve has nearly forgotten them and predicts nearly every access hits."""
    quotas = tenant_curves.AutoQuotas(64, 0.1)
    for _ in range(4):
        for prompt in range(3):
            quotas.observe(5, blocks(*range(4 * prompt, 4 * prompt + 4)))
        quotas.look()
    assert quotas.predicted_hit_rate(5, "run") == pytest.approx(36 / 48)
    assert quotas.predicted_hit_rate(5) > 0.9
    assert quotas.predicted_hit_rate(6) is None and quotas.predicted_hit_rate(6, "run") is None


def test_the_served_prediction_prices_each_access_at_the_quota_it_came_under():
    """A tenant cycling over 3 prompts of 4 blocks (each block's reuse distance: the 11 others)
    needs 12 blocks; while a neighbour holds most of the cache it has 6, and its curve predicts
    its repeats miss; after its quota grows to 12, that they hit. The run-long prediction
    prices every access at the final quota; the served one, each at the quota of its time."""
    quotas = tenant_curves.AutoQuotas(64, 0.1)
    quotas.quota = {5: 6, 9: 58}  # as a look had shared it out
    for prompt in (0, 1, 2, 0, 1, 2):
        quotas.observe(5, blocks(*range(4 * prompt, 4 * prompt + 4)))
    assert quotas.predicted_hit_rate(5, "served") == 0.0  # 12 first accesses, 12 at distance 11
    quotas.quota = {5: 12, 9: 52}
    for prompt in (0, 1, 2):
        quotas.observe(5, blocks(*range(4 * prompt, 4 * prompt + 4)))
    assert quotas.predicted_hit_rate(5, "served") == pytest.approx(12 / 36)
    assert quotas.predicted_hit_rate(5, "run") == pytest.approx(24 / 36)
