import math

import pytest

from replicas.kv.events import KVEvent, KVEventBatch, KVSnapshot, Tier
from replicas.kv.hashing import block_hashes
from replicas.step_costs import PullCosts
from router.config import RoutingConfig
from router.router import NoLiveReplicaError, Router
from router.stats import MATCHED_FRACTION_BUCKETS

BLOCK = 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def stored(*indices: int, tier: str = "npu") -> tuple[KVEvent, ...]:
    return tuple(KVEvent("stored", tier, h(i)) for i in indices)


def removed(*indices: int, tier: str = "npu") -> tuple[KVEvent, ...]:
    return tuple(KVEvent("removed", tier, h(i)) for i in indices)


def prompt(*indices: int) -> list[bytes]:
    return [h(i) for i in indices]


def make_router(num_replicas: int = 3, **config) -> Router:
    return Router(num_replicas, BLOCK, RoutingConfig(**config))


def test_route_prefers_the_cached_prefix_and_charges_the_prompt():
    router = make_router()
    assert router.on_events(KVEventBatch(2, 0, stored(1, 2, 3)))
    decision = router.route("a", 64, prompt(1, 2, 3, 4))
    assert decision.replica_index == 2
    assert (decision.num_matched_tokens, decision.num_matched_tokens_by_tier) == (48, (48, 0, 0))
    assert decision.prefix_score == 0.75 and decision.load_score == 1.0
    assert decision.score == pytest.approx(0.55 * 0.75 + 0.45)
    assert router.stats().replicas[2].load_tokens == 64
    router.check_integrity()


def test_load_spreads_cold_requests_and_is_released_idempotently():
    router = make_router(2)
    assert router.route("a", 100, []).replica_index == 0  # tie: lowest index
    assert router.route("b", 100, []).replica_index == 1  # replica 0 now carries load
    router.add_generated("a", 50)
    assert router.route("c", 10, []).replica_index == 1  # 150 on 0 vs 100 on 1
    assert [r.load_tokens for r in router.stats().replicas] == [150, 110]
    router.release("a")
    router.release("a")  # completion and abort may both arrive
    router.add_generated("a", 5)
    assert [r.load_tokens for r in router.stats().replicas] == [0, 110]
    assert router.route("d", 10, []).replica_index == 0
    router.check_integrity()


def test_a_request_id_cannot_be_routed_twice_while_active():
    router = make_router()
    router.route("a", 16, [])
    with pytest.raises(ValueError, match="already routed"):
        router.route("a", 16, [])


def test_event_gap_needs_resync_and_events_wait_for_the_snapshot():
    router = make_router(2)
    assert router.on_events(KVEventBatch(1, 0, stored(1)))
    assert not router.on_events(KVEventBatch(1, 2, stored(2)))  # event 1 was lost
    assert router.needs_resync() == [1]
    assert not router.on_events(KVEventBatch(1, 1, stored(3)))  # ignored until resync
    assert router.route("a", 32, prompt(1, 3)).num_matched_tokens == 16  # stale index still used
    assert router.resync(KVSnapshot(1, 5, {"full": {"npu": (h(1), h(2)), "host": (h(3),)}}))
    assert router.needs_resync() == []
    assert router.route("b", 48, prompt(1, 2, 3)).num_matched_tokens_in(Tier.HOST) == 16
    assert router.on_events(KVEventBatch(1, 4, removed(1)))  # already covered by the snapshot
    assert router.route("c", 16, prompt(1)).num_matched_tokens == 16
    assert router.on_events(KVEventBatch(1, 5, removed(1)))  # continues from next_seq
    for request_id in "abc":  # their prompts were pending on replica 1 until now
        router.release(request_id)
    assert router.route("d", 16, prompt(1)).num_matched_tokens == 0
    stats = router.stats().replicas[1]
    assert (stats.num_event_gaps, stats.num_resyncs, stats.needs_resync) == (1, 1, False)
    router.check_integrity()


def test_requested_resync_ignores_events_until_the_snapshot():
    router = make_router(2)
    router.request_resync(0)
    router.mark_dead(1)
    router.request_resync(1)  # a dead replica has nothing to resync
    assert router.needs_resync() == [0]
    assert not router.on_events(KVEventBatch(0, 0, stored(1)))
    assert router.resync(KVSnapshot(0, 3, {"full": {"npu": (h(2),)}}))
    assert router.on_events(KVEventBatch(0, 3, stored(1)))
    assert router.route("a", 32, prompt(2, 1)).num_matched_tokens == 32
    assert not router.resync(KVSnapshot(1, 0, {"full": {"npu": (h(2),)}}))
    router.check_integrity()


def test_stale_batches_are_ignored_and_overlapping_ones_apply_their_tail():
    router = make_router(1)
    assert router.on_events(KVEventBatch(0, 0, stored(1, 2)))
    assert router.on_events(KVEventBatch(0, 0, removed(1, 2)))  # entirely seen: ignored
    assert router.route("a", 32, prompt(1, 2)).num_matched_tokens == 32
    assert router.on_events(KVEventBatch(0, 1, stored(2) + stored(3)))  # seq 1 seen, 2 new
    assert router.route("b", 48, prompt(1, 2, 3)).num_matched_tokens == 48
    assert router.on_events(KVEventBatch(0, 3, ()))
    assert router.needs_resync() == []


def test_an_in_step_replica_ignores_an_older_snapshot():
    router = make_router(1)
    router.on_events(KVEventBatch(0, 0, stored(1, 2, 3)))
    assert not router.resync(KVSnapshot(0, 1, {"full": {"npu": (h(1),)}}))
    assert router.stats().replicas[0].num_indexed_blocks_in(Tier.NPU) == 3


def test_dead_replica_is_dropped_with_its_index_and_load():
    router = make_router(2)
    router.on_events(KVEventBatch(0, 0, stored(1, 2)))
    assert router.route("a", 32, prompt(1, 2)).replica_index == 0
    router.mark_dead(0)
    assert router.live_replicas() == [1]
    stats = router.stats()
    assert not stats.replicas[0].is_live
    assert stats.replicas[0].load_tokens == 0
    assert stats.replicas[0].num_indexed_blocks_by_tier == (0, 0, 0)
    assert stats.num_indexed_hashes == 0
    assert not router.on_events(KVEventBatch(0, 2, stored(3)))  # a dead replica is not indexed
    assert router.needs_resync() == []
    assert router.route("b", 32, prompt(1, 2)).replica_index == 1
    router.release("a")  # its request died with it: nothing to release
    assert [r.load_tokens for r in router.stats().replicas] == [0, 32]
    router.check_integrity()


def test_no_live_replica_is_a_clear_error():
    router = make_router(2)
    router.mark_dead(0)
    router.mark_dead(1)
    with pytest.raises(NoLiveReplicaError, match="no live replica"):
        router.route("a", 16, [])


def test_a_rejoining_replica_starts_empty_and_expects_the_given_seq():
    router = make_router(2)
    router.on_events(KVEventBatch(1, 0, stored(1)))
    router.mark_dead(1)
    router.mark_alive(1)
    assert router.live_replicas() == [0, 1]
    assert router.route("a", 16, prompt(1)).num_matched_tokens == 0
    assert router.on_events(KVEventBatch(1, 0, stored(1)))  # a fresh process counts from 0
    assert router.route("b", 16, prompt(1)).replica_index == 1
    router.mark_alive(0, next_seq=7)
    assert router.on_events(KVEventBatch(0, 0, stored(2)))  # before seq 7: stale, ignored
    assert router.route("c0", 16, prompt(2)).num_matched_tokens == 0
    assert router.on_events(KVEventBatch(0, 7, stored(2)))
    assert router.route("c", 16, prompt(2)).num_matched_tokens == 16
    router.check_integrity()


def test_with_prefix_caching_off_routing_follows_load():
    router = make_router(2, scoring_profile="locality", enable_prefix_caching=False)
    router.on_events(KVEventBatch(0, 0, stored(1, 2, 3, 4)))
    router.route("a", 1000, [])
    # Locality would keep the cached replica 0; the load profile sends it to idle replica 1.
    assert router.route("b", 64, prompt(1, 2, 3, 4)).replica_index == 1


def test_round_robin_router_skips_dead_replicas():
    router = make_router(3, policy="round-robin")
    router.on_events(KVEventBatch(2, 0, stored(1)))
    picks = [router.route(f"r{i}", 16, prompt(1)).replica_index for i in range(4)]
    assert picks == [0, 1, 2, 0]
    router.mark_dead(1)
    assert [router.route(f"s{i}", 16, []).replica_index for i in range(3)] == [2, 0, 2]


def test_stats_count_decisions_and_matched_fraction_buckets():
    router = make_router(2)
    router.on_events(KVEventBatch(0, 0, stored(1, 2, 3, 4)))
    router.on_events(KVEventBatch(0, 4, stored(5, 6, tier="host")))
    # First, while no replica has been sent anything: the exact tie goes to replica 0.
    router.route("cold", 0, [])  # an empty prompt counts as fraction 0
    router.route("full", 64, prompt(1, 2, 3, 4))  # fraction 1.0
    router.route("half", 64, prompt(1, 2, 9, 9))  # 0.5
    router.route("host", 64, prompt(1, 2, 3, 4, 5, 6, 9)[:4])  # 1.0 again
    router.release("full")
    router.release("half")
    router.release("host")
    stats = router.stats()
    zero, one = stats.replicas
    assert zero.num_requests_routed == 4 and one.num_requests_routed == 0
    assert zero.matched_fraction_count == 4 and zero.matched_fraction_sum == 2.5
    assert len(zero.matched_fraction_bucket_counts) == len(MATCHED_FRACTION_BUCKETS)
    assert zero.matched_fraction_bucket_counts == (1, 1, 1, 2, 2, 2, 4)  # cumulative (le)
    assert zero.num_matched_tokens == 160 and zero.num_matched_tokens_by_tier == (160, 0, 0)
    assert zero.num_indexed_blocks_by_tier == (4, 2, 0)
    assert stats.num_indexed_hashes == 6
    assert one.matched_fraction_bucket_counts == (0,) * 7 and one.is_live


def test_host_matches_are_counted_per_tier_in_stats():
    router = make_router(1)
    router.on_events(KVEventBatch(0, 0, stored(1) + stored(2, tier="host")))
    decision = router.route("a", 40, prompt(1, 2))
    assert decision.num_matched_tokens_by_tier == (16, 16, 0)
    assert decision.prefix_score == pytest.approx((1 + 0.9) * 16 / 40)
    stats = router.stats().replicas[0]
    assert stats.num_matched_tokens_by_tier == (16, 16, 0)
    assert stats.matched_fraction_bucket_counts == (0, 0, 0, 0, 0, 1, 1)  # 0.8


def pull_costs(read_ms: float, recompute_ms: float = 10.0) -> PullCosts:
    """Costs per block: read from a peer ``read_ms``, load 0.5 ms, compute ``recompute_ms``."""
    return PullCosts(recompute_ms / 1e3 / BLOCK, 0.0, read_ms / 1e3, 0.5e-3, 4 * BLOCK, BLOCK)


def test_pull_costs_price_a_pull_against_computing_it():
    cheap = pull_costs(read_ms=1.5)  # 2 ms a block against 10
    assert cheap.break_even_blocks() == 1 and cheap.break_even_blocks(wait_s=0.02) == 3
    assert cheap.pays(3, 0, 0.02) and not cheap.pays(2, 0, 0.02)
    assert cheap.source_wait_s(10 * BLOCK) == pytest.approx(0.04)  # one step: 4 blocks' prefill
    assert pull_costs(read_ms=9.5).break_even_blocks() == math.inf
    context = PullCosts(1e-3, 1e-5, 0.02, 0.0, 64, BLOCK)  # 17 ms a block cold, 20 a pull
    assert not context.pays(1, 0, 0.0) and context.pays(1, 10 * BLOCK, 0.0)  # deep: dearer


def test_the_source_is_named_only_where_the_reported_pull_beats_recompute():
    router = make_router(3, peer_pull_min_blocks=1)
    assert router.on_events(KVEventBatch(0, 0, stored(*range(1, 9))))  # 8 blocks on 0
    assert router.stats().replicas[1].peer_break_even_blocks is None  # not reported yet
    router.set_pull_costs(1, pull_costs(read_ms=12.0))  # a pull costs more than computing
    dear = router.route("a", 9 * BLOCK, prompt(*range(1, 10)), exclude={0})
    assert dear.replica_index == 1 and dear.peer_source is None
    stats = router.stats().replicas[1]
    assert stats.num_peer_priced_out == 1 and stats.peer_break_even_blocks == math.inf
    router.set_pull_costs(2, pull_costs(read_ms=1.5))
    cheap = router.route("b", 9 * BLOCK, prompt(*range(1, 10)), exclude={0, 1})
    assert (cheap.replica_index, cheap.peer_source) == (2, 0)
    assert router.stats().replicas[2].peer_break_even_blocks == 1
    # a busy source makes the pull wait for its step: 8 blocks no longer pay 4 blocks' prefill
    router.release("b")  # its prompt no longer pending on 2
    router.set_pull_costs(0, pull_costs(read_ms=1.5, recompute_ms=80.0))
    router.route("busy", 64 * BLOCK, [], exclude={1, 2})  # queued prefill on 0
    waits = router.route("c", 9 * BLOCK, prompt(*range(1, 10)), exclude={0, 1})
    assert waits.peer_source is None and router.stats().replicas[2].num_peer_priced_out == 1
    router.check_integrity()


def test_a_fan_out_spreads_to_replicas_that_can_pull_the_prefix_once_it_would_queue():
    prefix = prompt(*range(1, 33))  # 32 blocks, held by replica 0

    def burst(router) -> list:
        tails = [prompt(*range(100 + 10 * i, 108 + 10 * i)) for i in range(16)]  # 8 own blocks
        return [router.route(f"b{i}", 40 * BLOCK, prefix + t) for i, t in enumerate(tails)]

    floor_only = make_router(2, peer_pull_min_blocks=1)
    floor_only.on_events(KVEventBatch(0, 0, stored(*range(1, 33))))
    assert {d.replica_index for d in burst(floor_only)} == {0}  # the other would compute it
    router = make_router(2, peer_pull_min_blocks=1)
    router.on_events(KVEventBatch(0, 0, stored(*range(1, 33))))
    for replica in (0, 1):
        router.set_pull_costs(replica, pull_costs(read_ms=1.5))  # a pull: 2 ms a block of 10
    first, *rest = [d for d in burst(router) if d.replica_index == 1]
    assert (first.peer_source, first.num_peer_tokens) == (0, 32 * BLOCK)  # pulls it
    assert 0 < first.num_matched_tokens < 32 * BLOCK  # credited part of the pull
    # the next ones there match the prefix routed to it already (its pull brings it)
    assert rest and all(d.num_matched_tokens == 32 * BLOCK for d in rest)
    router.check_integrity()


def test_excluded_replicas_are_not_candidates():
    router = Router(3, 4, RoutingConfig(scoring_profile="locality"))
    hashes = block_hashes(list(range(16)), 4)
    assert router.route("a", 16, hashes).replica_index == 0
    router.release("a")
    assert router.route("b", 16, hashes, exclude=[0]).replica_index == 1
    assert router.route("c", 16, hashes, exclude=[0, 1]).replica_index == 2
    with pytest.raises(NoLiveReplicaError, match="turned the request away"):
        router.route("d", 16, hashes, exclude=[0, 1, 2])


def test_a_replica_holding_a_longer_prefix_is_named_the_source_to_pull_it_from():
    router = make_router(3)
    assert router.on_events(KVEventBatch(0, 0, stored(*range(1, 9))))  # 8 blocks on 0
    assert router.on_events(KVEventBatch(1, 0, stored(1, 2, tier="host")))  # 2 on 1
    decision = router.route("a", 9 * BLOCK, prompt(*range(1, 10)), exclude={0, 1})  # 0 full
    assert decision.replica_index == 2
    assert (decision.peer_source, decision.num_peer_tokens) == (0, 8 * BLOCK)
    assert router.stats().replicas[2].num_peer_sources == 1
    near = router.route("b", 9 * BLOCK, prompt(*range(1, 10)), exclude={0, 2})  # holds 2 of 8
    assert near.replica_index == 1 and near.peer_source == 0  # 6 more: pulled
    # a prompt routed to a replica and not computed yet is not a source (nothing to export)
    pending = router.route("e", 9 * BLOCK, prompt(*range(1, 10)), exclude={0, 1})
    assert pending.replica_index == 2 and pending.peer_source is None  # 2 holds it pending
    off = make_router(3, peer_pull_min_blocks=7)
    assert off.on_events(KVEventBatch(0, 0, stored(*range(1, 9))))
    assert off.on_events(KVEventBatch(1, 0, stored(1, 2)))
    short = off.route("c", 9 * BLOCK, prompt(*range(1, 10)), exclude={0, 2})
    assert short.peer_source is None  # 6 more blocks: fewer than 7
    best = off.route("d", 9 * BLOCK, prompt(*range(1, 10)))
    assert best.replica_index == 0 and best.peer_source is None  # the holder itself


def test_a_request_sent_past_an_overloaded_holder_is_counted_per_chosen_replica():
    router = make_router(2)
    router.on_events(KVEventBatch(0, 0, stored(1, 2, 3, 4)))
    # Replica 0 caches the prompt; past 16 x 64 tokens (1024 + 64 > 16 x (0 + 64)) it is left out.
    for n in range(16):
        assert router.route(f"warm{n}", 64, prompt(1, 2, 3, 4)).replica_index == 0
    decision = router.route("next", 64, prompt(1, 2, 3, 4))
    assert decision.replica_index == 1 and decision.is_overload_diversion
    assert decision.peer_source == 0  # and may pull the prefix from the holder
    counts = [r.num_overload_diversions for r in router.stats().replicas]
    assert counts == [0, 1]
    router.check_integrity()
