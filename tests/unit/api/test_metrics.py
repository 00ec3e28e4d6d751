"""Prometheus metrics: replica stats rendered at scrape time, request latencies from the app."""

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cluster.api import create_app
from cluster.backend import ClusterStats, ReplicaStats
from cluster.metrics import StrataMetrics, router_metric_families
from replicas.engine.core import SpecDecodeStats
from replicas.engine.engine import EngineStats
from replicas.kv.events import Tier
from replicas.kv.records import CacheStats, CacheTypeStats, CacheTypeUsage, TierUsage
from replicas.kv.transfer import TransferStats
from tests.unit.api.conftest import ScriptedBackend


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition, keyed by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def usage(npu: tuple[int, int, int], host: tuple[int, int, int]) -> CacheTypeUsage:
    return CacheTypeUsage({Tier.NPU: TierUsage(*npu), Tier.HOST: TierUsage(*host)})


def engine_stats(scale: int) -> EngineStats:
    cache = CacheStats(
        queries=100 * scale, hits=48 * scale,
        hits_by_source={Tier.NPU: 32 * scale, Tier.HOST: 16 * scale},
        evictions={Tier.NPU: 5 * scale, Tier.HOST: 2 * scale}, write_through_promotions=3 * scale,
        write_backs=4 * scale, blocks_loaded=1 * scale, blocks_stored=7 * scale,
        reserved_blocks=6 * scale, reservations=8 * scale, prefetched_blocks=9 * scale,
        prefetched_blocks_used=5 * scale, reservations_dropped=2 * scale,
        by_cache_type={"sliding": CacheTypeStats(blocks_loaded=3 * scale,
                                                 blocks_freed_out_of_window=5 * scale)},
    )  # fmt: skip
    transfer = TransferStats(
        blocks_loaded=scale, blocks_stored=7 * scale, bytes_loaded=1024 * scale,
        bytes_stored=7168 * scale, seconds=0.5 * scale,
    )  # fmt: skip
    return EngineStats(
        cache=cache, transfer=transfer, num_running=2 * scale, num_waiting=scale,
        num_preemptions=scale, spec_decode=SpecDecodeStats(12 * scale, 7 * scale),
        cache_types={
            "full": usage((128, 10 * scale, 20 * scale), (64, 9 * scale, 30 * scale)),
            "sliding": usage((32, 3 * scale, 4 * scale), (16, scale, 2 * scale)),
        },
    )  # fmt: skip


def test_replica_stats_are_exported_per_replica():
    stats = ClusterStats(
        [ReplicaStats(0, True, engine_stats(1)), ReplicaStats(1, True, engine_stats(2)),
         ReplicaStats(2, False, None)]
    )  # fmt: skip
    got = samples(StrataMetrics().render(stats).decode())

    def value(name: str, **labels: str) -> float:
        return got[(name, frozenset(labels.items()))]

    for replica, scale in (("0", 1), ("1", 2)):
        assert value("strata_replica_up", replica=replica) == 1
        assert value("strata_prefix_cache_queries_total", replica=replica) == 100 * scale
        assert value("strata_prefix_cache_hits_total", replica=replica) == 48 * scale
        hits = "strata_prefix_cache_hits_by_tier_total"
        assert value(hits, replica=replica, tier="npu") == 32 * scale
        assert value(hits, replica=replica, tier="host") == 16 * scale
        assert value("strata_kv_evictions_total", replica=replica, tier="npu") == 5 * scale
        assert value("strata_kv_evictions_total", replica=replica, tier="host") == 2 * scale
        assert value("strata_kv_write_through_promotions_total", replica=replica) == 3 * scale
        assert value("strata_kv_write_backs_total", replica=replica) == 4 * scale
        assert value("strata_kv_blocks_loaded_total", replica=replica) == scale
        assert value("strata_kv_blocks_stored_total", replica=replica) == 7 * scale
        assert value("strata_kv_bytes_loaded_total", replica=replica) == 1024 * scale
        assert value("strata_kv_bytes_stored_total", replica=replica) == 7168 * scale
        assert value("strata_kv_transfer_seconds_total", replica=replica) == 0.5 * scale
        assert value("strata_num_preemptions_total", replica=replica) == scale
        assert value("strata_spec_decode_draft_tokens_total", replica=replica) == 12 * scale
        assert value("strata_spec_decode_accepted_tokens_total", replica=replica) == 7 * scale
        assert value("strata_kv_reserved_blocks", replica=replica) == 6 * scale
        assert value("strata_kv_reservations_total", replica=replica) == 8 * scale
        assert value("strata_kv_prefetched_blocks_total", replica=replica) == 9 * scale
        assert value("strata_kv_prefetched_blocks_used_total", replica=replica) == 5 * scale
        assert value("strata_kv_reservations_dropped_total", replica=replica) == 2 * scale
        assert value("strata_num_requests_running", replica=replica) == 2 * scale
        assert value("strata_num_requests_waiting", replica=replica) == scale
        full = {"replica": replica, "cache_type": "full"}
        assert value("strata_kv_blocks_used", tier="npu", **full) == 10 * scale
        assert value("strata_kv_blocks_used", tier="host", **full) == 9 * scale
        assert value("strata_kv_blocks_capacity", tier="npu", **full) == 128
        assert value("strata_kv_blocks_capacity", tier="host", **full) == 64
        assert value("strata_kv_blocks_cached", tier="host", **full) == 30 * scale
        sliding = {"replica": replica, "cache_type": "sliding"}
        assert value("strata_kv_blocks_used", tier="npu", **sliding) == 3 * scale
        assert value("strata_kv_blocks_capacity", tier="host", **sliding) == 16
        assert value("strata_kv_cache_type_blocks_total", event="loaded", **sliding) == 3 * scale
        assert (
            value("strata_kv_cache_type_blocks_total", event="released_out_of_window", **sliding)
            == 5 * scale
        )
    assert value("strata_replica_up", replica="2") == 0
    assert ("strata_prefix_cache_queries_total", frozenset({("replica", "2")})) not in got


def test_router_extension_point_is_empty_without_a_router():
    assert router_metric_families(None) == []


def test_app_observes_request_latencies():
    backend = ScriptedBackend()  # two outputs of one token each, from replica 3
    with TestClient(create_app(backend)) as client:
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
        body = {"prompt": "hi", "stream": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        got = samples(client.get("/metrics").text)
    replica = frozenset({("replica", "3")})
    assert got[("strata_time_to_first_token_seconds_count", replica)] == 2
    assert got[("strata_inter_token_latency_seconds_count", replica)] == 2
    assert got[("strata_e2e_request_latency_seconds_count", replica)] == 2
    finished = frozenset({("replica", "3"), ("finish_reason", "length")})
    assert got[("strata_requests_total", finished)] == 2
    assert got[("strata_replica_up", replica)] == 1


def test_the_miss_ratio_curve_and_ghost_records_are_exported():
    from replicas.kv.retention import RetentionStats, ShadowKey

    stats = engine_stats(1)  # 100 prompt tokens
    stats.retention = {
        "full": RetentionStats(
            ghost_hits_dropped=7,
            ghost_hits_host_evicted=3,
            num_ghosts_dropped=11,
            num_ghosts_host_evicted=5,
            estimated_host_hit_tokens={
                ShadowKey(1.0, "off"): 16,
                ShadowKey(1.0, "on"): 40,
                ShadowKey(2.0, "off"): 24,
                ShadowKey(0.5, "off"): 8,
            },
            adaptive_stores=2,
            adaptive_skips=9,
        )
    }
    got = samples(StrataMetrics().render(ClusterStats([ReplicaStats(0, True, stats)])).decode())

    def value(name: str, **labels: str) -> float:
        return got[(name, frozenset({"replica": "0", "cache_type": "full", **labels}.items()))]

    estimate = "strata_kv_host_hit_rate_estimate"
    assert value(estimate, capacity_factor="1", write_back="off") == 0.16
    assert value(estimate, capacity_factor="1", write_back="on") == 0.40
    assert value(estimate, capacity_factor="2", write_back="off") == 0.24
    assert value(estimate, capacity_factor="0.5", write_back="off") == 0.08
    assert value("strata_kv_ghost_hits_total", ghost="dropped") == 7
    assert value("strata_kv_ghost_hits_total", ghost="host_evicted") == 3
    assert value("strata_kv_ghost_blocks", ghost="dropped") == 11
    assert value("strata_kv_adaptive_decisions_total", decision="store") == 2
    assert value("strata_kv_adaptive_decisions_total", decision="skip") == 9
