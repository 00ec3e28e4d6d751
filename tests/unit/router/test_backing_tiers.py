"""A backing tier registered at runtime is followed by the router like disk: its blocks continue a
replica's NPU/host run (each credited to the nearest backing tier holding it), scored with its
weight, read across a node only when the tier is shared by node; the config validates its
options, the metrics show its series and the admin reset accepts its name."""

import re

import pytest
from prometheus_client.core import Metric

from cluster.api.protocol import ResetPrefixCacheRequest
from cluster.backend import ClusterStats, ReplicaStats
from cluster.metrics import StrataMetrics
from cluster.router_metrics import router_metric_families
from replicas.kv.events import (
    KVEvent,
    KVEventBatch,
    KVEventKind,
    KVSnapshot,
    Tier,
    TierTraits,
    register_tier,
    tiers,
)
from replicas.kv.hashing import block_hashes
from replicas.kv.records import TierUsage
from router.config import RoutingConfig, TTFTCosts
from router.policies import TTFTPolicy
from router.router import Router
from tests.tier_registry import restored_tier_registry
from tests.unit.api.test_metrics import engine_stats
from tests.unit.api.test_metrics import samples as exposition_samples

BS = 16
PROMPT = list(range(8 * BS + 3))  # 8 full blocks
HASHES = block_hashes(PROMPT, BS)
MEMO = TierTraits("memo_test", shared_by_node=False, hit_weight=0.6)


@pytest.fixture
def registry():
    """Put the tier registry back as it was after the test (``tests.tier_registry``)."""
    with restored_tier_registry():
        yield


@pytest.fixture
def memo(registry):
    """The test tier, registered for one test."""
    return register_tier(MEMO)


def stored(tier, hashes) -> tuple[KVEvent, ...]:
    return tuple(KVEvent(KVEventKind.STORED, tier, h) for h in hashes)


def matches(router: Router) -> list[tuple[int, ...]]:
    """Each replica's cached prefix of ``PROMPT`` per tier, as the router scores them (none for
    a replica not routed to)."""
    return [m.num_blocks_by_tier for m in router._caches.match(HASHES, router.live_replicas())]


def test_a_tier_registered_after_the_router_started_is_credited_and_scored_with_its_weight(
    registry,
):
    router = Router(2, BS, RoutingConfig(scoring_profile="locality"))
    router.set_nodes(["a", "b"])
    assert matches(router) == [(0, 0, 0), (0, 0, 0)]  # built and used before the tier exists
    memo = register_tier(MEMO)
    assert tiers()[-1] == memo and memo.traits.hit_weight == 0.6
    router.on_events(KVEventBatch(0, 0, stored(Tier.NPU, HASHES[:2]) + stored(memo, HASHES[2:6])))
    router.on_events(KVEventBatch(1, 0, stored(Tier.NPU, HASHES[:4])))
    assert matches(router) == [(2, 0, 0, 4), (4, 0, 0, 0)]  # npu, host, disk, memo_test
    match = router._caches.match(HASHES, [0, 1])[0]
    expected = (2 + 0.6 * 4) * BS / len(PROMPT)  # 4.4 weighted blocks against 4 NPU blocks
    assert router._policy.prefix_score(match, len(PROMPT)) == pytest.approx(expected)
    decision = router.route("r", len(PROMPT), HASHES)
    assert decision.replica_index == 0 and decision.prefix_score == pytest.approx(expected)
    assert decision.num_matched_tokens_in(memo) == 4 * BS
    assert decision.num_matched_tokens_by_tier == (2 * BS, 0, 0, 4 * BS)
    stats = router.stats().replicas
    assert [s.num_indexed_blocks_in(memo) for s in stats] == [4, 0]
    assert [s.num_matched_tokens_in(memo) for s in stats] == [4 * BS, 0]
    router.check_integrity()


def test_tier_hit_weights_override_the_registered_weight(memo):
    router = Router(2, BS, RoutingConfig(scoring_profile="locality", tier_hit_weights={memo: 0.2}))
    router.on_events(KVEventBatch(0, 0, stored(Tier.NPU, HASHES[:2]) + stored(memo, HASHES[2:6])))
    router.on_events(KVEventBatch(1, 0, stored(Tier.NPU, HASHES[:4])))
    assert router._policy.tier_weights() == (1.0, 0.9, 0.7, 0.2)
    decision = router.route("r", len(PROMPT), HASHES)  # 2 + 0.2 x 4 = 2.8 < 4 NPU blocks
    assert decision.replica_index == 1


def test_each_block_is_credited_to_the_nearest_backing_tier_holding_it(memo):
    router = Router(1, BS, RoutingConfig())
    announced = (
        stored(Tier.NPU, HASHES[:1]) + stored(memo, HASHES[1:7]) + stored("disk", HASHES[2:4])
    )
    router.on_events(KVEventBatch(0, 0, announced))
    # block 1: memo only; 2-3: disk (nearer) and memo; 4-6: memo; block 7: nowhere
    assert matches(router) == [(1, 0, 2, 4)]
    decision = router.route("r", len(PROMPT), HASHES)
    expected = (1 + 0.7 * 2 + 0.6 * 4) * BS / len(PROMPT)
    assert decision.prefix_score == pytest.approx(expected)


def test_a_replica_local_tier_is_not_read_by_its_node_peers_while_disk_is(memo):
    router = Router(3, BS, RoutingConfig())
    router.set_nodes(["a", "a", "b"])
    router.on_events(KVEventBatch(0, 0, stored(Tier.DISK, HASHES[:3]) + stored(memo, HASHES[:6])))
    assert matches(router) == [
        (0, 0, 3, 3),  # the writer: its node's disk, then its own memo blocks
        (0, 0, 3, 0),  # its node peer: the disk blocks only
        (0, 0, 0, 0),  # another node
    ]
    router.mark_dead(0)  # nobody else reads its memo blocks: dropped; its disk blocks stay
    assert matches(router) == [(0, 0, 0, 0), (0, 0, 3, 0), (0, 0, 0, 0)]
    assert router.stats().replicas[0].num_indexed_blocks_by_tier == (0, 0, 3, 0)
    router.check_integrity()


def test_snapshots_and_retirement_follow_the_tier_by_its_traits(memo):
    router = Router(2, BS, RoutingConfig())
    router.set_nodes(["a", "a"])
    router.request_resync(0)
    snapshot = KVSnapshot(0, 9, {"full": {Tier.DISK: tuple(HASHES[:2]), memo: tuple(HASHES[:5])}})
    assert router.resync(snapshot)
    assert matches(router) == [(0, 0, 2, 3), (0, 0, 2, 0)]
    router.retire(0, snapshot)  # its node's disk stays readable, its own tier goes with it
    assert matches(router) == [(0, 0, 0, 0), (0, 0, 2, 0)]
    assert router._caches.num_blocks_by_tier(0) == (0, 0, 2, 0)
    router.check_integrity()


def test_a_replica_added_after_the_tier_is_registered_reads_it(registry):
    router = Router(1, BS, RoutingConfig())
    memo = register_tier(MEMO)
    assert router.add_replica("a") == 1
    router.start_routing(1, ramp=False)
    router.on_events(KVEventBatch(1, 0, stored(memo, HASHES[:2])))
    assert matches(router) == [(0, 0, 0, 0), (0, 0, 0, 2)]
    router.check_integrity()


def test_the_ttft_profile_prices_the_tier_with_its_reload_cost_or_disks(memo):
    base = dict(prefill_s_per_token=0.0, reload_s_per_block=0.5, disk_reload_s_per_block=2.0)
    default = TTFTPolicy(BS, 0.9, TTFTCosts(**base))
    priced = TTFTPolicy(BS, 0.9, TTFTCosts(**base, tier_reload_s_per_block={memo: 3.0}))
    match = router_match(memo)
    assert default.predicted_ttft_s(match, len(PROMPT), 0, 0, 0) == 1 * 0.5 + 2 * 2.0 + 3 * 2.0
    assert priced.predicted_ttft_s(match, len(PROMPT), 0, 0, 0) == 1 * 0.5 + 2 * 2.0 + 3 * 3.0


def router_match(memo):
    """A match of 1 NPU, 1 host, 2 disk and 3 ``memo`` blocks, as the router builds it."""
    router = Router(1, BS, RoutingConfig())
    pooled = stored(Tier.NPU, HASHES[:1]) + stored(Tier.HOST, HASHES[1:2])
    backing = stored(Tier.DISK, HASHES[2:4]) + stored(memo, HASHES[4:7])
    router.on_events(KVEventBatch(0, 0, pooled + backing))
    return router._caches.match(HASHES, [0])[0]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tier_hit_weights": {"tape": 0.5}}, "routing.tier_hit_weights names 'tape'"),
        ({"tier_hit_weights": {"memo_test": 1.5}}, "must be between 0 and 1"),
        ({"tier_hit_weights": {"disk": 0.5}}, "--data-parallel-disk-hit-weight"),
        ({"tier_hit_weights": {"host": 0.5}}, "--data-parallel-host-hit-weight"),
    ],
)
def test_tier_hit_weights_are_validated(memo, kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        RoutingConfig(**kwargs)


@pytest.mark.parametrize(
    ("costs", "words"),
    [({"disk": 1.0}, "names 'disk'"), ({"memo_test": -1.0}, "non-negative"), ({"x": 1.0}, "'x'")],
)
def test_tier_reload_costs_are_validated(memo, costs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        TTFTCosts(prefill_s_per_token=0.0, tier_reload_s_per_block=costs)


def test_an_unregistered_tier_is_refused_until_registered():
    with pytest.raises(ValueError, match=r"routing\.tier_hit_weights names 'memo_test'"):
        RoutingConfig(tier_hit_weights={"memo_test": 0.5})
    with pytest.raises(ValueError, match="tier must be one of 'all', 'npu', 'host', 'disk'"):
        ResetPrefixCacheRequest.model_validate({"tier": "memo_test"})


def test_the_reset_request_accepts_a_tier_registered_later(memo):
    assert ResetPrefixCacheRequest.model_validate({"tier": "memo_test"}).tier == "memo_test"
    assert ResetPrefixCacheRequest.model_validate({}).tier == "all"


def test_the_router_metrics_show_the_tiers_blocks_once_held(memo):
    router = Router(2, BS, RoutingConfig())
    router.on_events(KVEventBatch(0, 0, stored(memo, HASHES[:3])))
    router.route("r", len(PROMPT), HASHES)
    families = {f.name: f for f in router_metric_families(router.stats())}
    assert samples(families["strata_router_indexed_blocks"]) == {
        ("0", "npu"): 0,
        ("0", "host"): 0,
        ("0", "memo_test"): 3,
        ("1", "npu"): 0,
        ("1", "host"): 0,
    }
    # a backing tier's matched tokens reach the NPU through host: the host series counts them
    assert samples(families["strata_router_matched_tokens"])[("0", "host")] == 3 * BS


def samples(family: Metric) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels.values()): s.value for s in family.samples}


def test_the_replica_metrics_show_the_tiers_series_once_it_is_on(memo):
    stats = engine_stats(1)
    stats.cache.evictions[memo] = 4
    stats.cache_types["full"].tiers[memo] = TierUsage(num_blocks=100, num_cached=7)
    text = StrataMetrics().render(ClusterStats([ReplicaStats(0, True, stats)])).decode()
    got = exposition_samples(text)

    def value(name: str, **labels: str) -> float | None:
        return got.get((name, frozenset({"replica": "0", **labels}.items())))

    assert value("strata_kv_evictions_total", tier="memo_test") == 4
    assert value("strata_kv_evictions_total", tier="npu") == 5
    assert value("strata_kv_evictions_total", tier="disk") is None  # disk is off
    assert value("strata_prefix_cache_hits_by_tier_total", tier="memo_test") == 0
    full = {"tier": "memo_test", "cache_type": "full"}
    assert value("strata_kv_blocks_capacity", **full) == 100
    assert value("strata_kv_blocks_cached", **full) == 7
    assert value("strata_kv_blocks_used", **full) is None  # a backing tier's slots are never held
    assert value("strata_kv_blocks_capacity", tier="memo_test", cache_type="sliding") is None
