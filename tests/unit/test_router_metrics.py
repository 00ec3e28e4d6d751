from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import router_metric_families
from replicas.kv.events import KVEvent, KVEventBatch
from router import Router, RoutingConfig


def scrape(router: Router) -> dict[str, list]:
    class Collector:
        def collect(self):
            return router_metric_families(router.stats())

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_router_metrics_per_replica():
    router = Router(2, 16, RoutingConfig(scoring_profile="locality"))
    hashes = [bytes([i]) * 16 for i in range(4)]
    router.on_events(KVEventBatch(1, 0, tuple(KVEvent("stored", "npu", h) for h in hashes[:2])))
    router.route("a", 64, hashes)  # replica 1 holds 2 of the 4 blocks
    families = scrape(router)
    routed = {s.labels["replica"]: s.value for s in families["strata_router_requests"]}
    assert routed == {"0": 0.0, "1": 1.0}
    matched = {
        (s.labels["replica"], s.labels["tier"]): s.value
        for s in families["strata_router_matched_tokens"]
    }
    assert matched[("1", "npu")] == 32.0 and matched[("1", "host")] == 0.0
    buckets = {
        s.labels["le"]: s.value
        for s in families["strata_router_matched_fraction"]
        if s.name.endswith("_bucket") and s.labels["replica"] == "1"
    }
    assert buckets["0.25"] == 0.0 and buckets["0.5"] == 1.0 and buckets["+Inf"] == 1.0
    load = {s.labels["replica"]: s.value for s in families["strata_router_load_tokens"]}
    assert load == {"0": 0.0, "1": 64.0}
    indexed = {
        (s.labels["replica"], s.labels["tier"]): s.value
        for s in families["strata_router_indexed_blocks"]
    }
    assert indexed[("1", "npu")] == 2.0 and indexed[("0", "npu")] == 0.0


def test_router_metrics_count_disk_matches_as_host_and_show_disk_blocks_once_held():
    router = Router(2, 16, RoutingConfig(scoring_profile="locality"))
    router.set_nodes(["a", "a"])
    hashes = [bytes([i]) * 16 for i in range(4)]
    stored = (KVEvent("stored", "npu", hashes[0]),) + tuple(
        KVEvent("stored", "disk", h) for h in hashes[1:3]
    )
    router.on_events(KVEventBatch(0, 0, stored))
    decision = router.route("a", 64, hashes)  # replica 0: 1 NPU block, then 2 disk blocks
    assert decision.replica_index == 0 and decision.num_matched_tokens_by_tier == (16, 0, 32)
    families = scrape(router)
    matched = {
        (s.labels["replica"], s.labels["tier"]): s.value
        for s in families["strata_router_matched_tokens"]
    }
    assert matched == {
        ("0", "npu"): 16.0,
        ("0", "host"): 32.0,
        ("1", "npu"): 0.0,
        ("1", "host"): 0.0,
    }
    indexed = {
        (s.labels["replica"], s.labels["tier"]): s.value
        for s in families["strata_router_indexed_blocks"]
    }
    assert indexed == {
        ("0", "npu"): 1.0,
        ("0", "host"): 0.0,
        ("0", "disk"): 2.0,
        ("1", "npu"): 0.0,
        ("1", "host"): 0.0,
    }


def test_router_metrics_count_overload_diversions_on_the_chosen_replica():
    router = Router(2, 16, RoutingConfig(overload_factor=2.0, peer_pull_min_blocks=0))
    hashes = [bytes([i]) * 16 for i in range(4)]
    router.on_events(KVEventBatch(0, 0, tuple(KVEvent("stored", "npu", h) for h in hashes)))
    for request in "ab":  # replica 0: 0 + 64, then 64 + 64, not over 2 x (0 + 64)
        assert router.route(request, 64, hashes).replica_index == 0
    assert router.route("c", 64, hashes).replica_index == 1  # 128 + 64 > 2 x 64
    families = scrape(router)
    diverted = {s.labels["replica"]: s.value for s in families["strata_router_overload_diversions"]}
    assert diverted == {"0": 0.0, "1": 1.0}
