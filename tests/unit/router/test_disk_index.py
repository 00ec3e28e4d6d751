"""The router credits a node's disk blocks to every live replica on that node, after its
NPU/host run, weighted below host hits; snapshots and restarts rebuild it."""

from replicas.kv.events import KVEvent, KVEventBatch, KVEventKind, KVSnapshot, Tier
from replicas.kv.hashing import block_hashes
from router.config import RoutingConfig
from router.prefix_index import IndexMatch
from router.router import Router

BS = 16
PROMPT = list(range(8 * BS + 3))  # 8 full blocks
HASHES = block_hashes(PROMPT, BS)


def events(tier: Tier, hashes, kind=KVEventKind.STORED) -> tuple[KVEvent, ...]:
    return tuple(KVEvent(kind, tier, h) for h in hashes)


def prefix_matches(router: Router) -> list[IndexMatch]:
    """The router's cached prefix of ``PROMPT`` on each live replica, as it scores them."""
    return router._caches.match(HASHES, router.live_replicas())


def test_a_disk_block_counts_for_every_replica_of_its_node_after_the_npu_run():
    router = Router(3, BS, RoutingConfig())
    router.set_nodes(["node-a", "node-a", "node-b"])
    assert router.on_events(KVEventBatch(0, 0, events(Tier.DISK, HASHES[:6])))
    assert router.on_events(KVEventBatch(1, 0, events(Tier.NPU, HASHES[:2])))
    matches = prefix_matches(router)
    assert [m.num_blocks_by_tier for m in matches] == [  # NPU, host, disk
        (0, 0, 6),  # the writer
        (2, 0, 4),  # its node peer: NPU blocks first, then the node's disk
        (0, 0, 0),  # another node
    ]
    decision = router.route("r", len(PROMPT), HASHES)
    assert decision.replica_index == 1  # 2 + 4 x 0.7 = 4.8 weighted blocks against 6 x 0.7
    assert decision.num_matched_tokens == 6 * BS
    assert decision.num_matched_tokens_by_tier == (2 * BS, 0, 4 * BS)
    stats = router.stats().replicas
    assert [s.num_indexed_blocks_in(Tier.DISK) for s in stats] == [6, 0, 0]
    router.check_integrity()


def test_disk_hits_weigh_less_than_npu_hits_and_the_weight_is_configurable():
    for weight, expected in ((0.7, 1), (1.0, 0)):
        router = Router(2, BS, RoutingConfig(disk_hit_weight=weight))
        router.set_nodes(["a", "b"])
        router.on_events(KVEventBatch(0, 0, events(Tier.DISK, HASHES[:8])))
        router.on_events(KVEventBatch(1, 0, events(Tier.NPU, HASHES[:6])))
        # 8 x 0.7 = 5.6 < 6 NPU blocks; at weight 1 the disk's 8 win
        assert router.route("r", len(PROMPT), HASHES).replica_index == expected


def test_removed_disk_blocks_and_snapshots_update_the_credit():
    router = Router(2, BS, RoutingConfig())
    router.set_nodes(["a", "a"])
    router.on_events(KVEventBatch(0, 0, events(Tier.DISK, HASHES[:5])))
    router.on_events(KVEventBatch(0, 5, events(Tier.DISK, HASHES[3:4], KVEventKind.REMOVED)))
    assert prefix_matches(router)[1].num_blocks_in(Tier.DISK) == 3
    router.request_resync(0)
    assert router.resync(KVSnapshot(0, 6, {"full": {Tier.DISK: tuple(HASHES[:7])}}))
    assert prefix_matches(router)[1].num_blocks_in(Tier.DISK) == 7
    router.check_integrity()


def test_a_dead_writers_blocks_stay_credited_and_a_rejoining_one_starts_empty():
    router = Router(2, BS, RoutingConfig())
    router.set_nodes(["a", "a"])
    router.on_events(KVEventBatch(0, 0, events(Tier.DISK, HASHES[:4])))
    router.mark_dead(0)
    assert prefix_matches(router)[1].num_blocks_in(Tier.DISK) == 4  # its files are still there
    router.mark_alive(0)
    assert prefix_matches(router)[1].num_blocks_in(Tier.DISK) == 0  # the new process announces
    router.check_integrity()
