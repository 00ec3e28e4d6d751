"""Resizing the router: replicas join, ramp up, drain and retire; indices are never reused."""

import pytest

from replicas.kv.events import KVEvent, KVEventBatch, KVSnapshot, Tier
from router.backing_index import BackingIndex
from router.config import RoutingConfig
from router.prefix_index import PrefixIndex
from router.router import NoLiveReplicaError, ReplicaRole, Router

BLOCK = 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def stored(*indices: int, tier: str = "npu") -> tuple[KVEvent, ...]:
    return tuple(KVEvent("stored", tier, h(i)) for i in indices)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_router(num_replicas: int = 2, clock: Clock | None = None, **config) -> Router:
    return Router(num_replicas, BLOCK, RoutingConfig(**config), clock=clock or Clock())


def test_a_joining_replica_is_indexed_but_not_routed_until_it_starts():
    router = make_router(2, scoring_profile="locality")
    assert router.add_replica("node-a") == 2
    assert router.on_events(KVEventBatch(2, 0, stored(1, 2, 3)))
    assert router.route("a", 64, [h(1), h(2), h(3), h(4)]).replica_index != 2
    router.release("a")  # no longer pending (cached) on the replica it went to
    router.start_routing(2, ramp=False)
    assert router.route("b", 64, [h(1), h(2), h(3), h(4)]).replica_index == 2
    assert [r.role for r in router.stats().replicas] == ["serving"] * 3
    router.check_integrity()


def test_a_draining_replica_gets_nothing_new_and_a_retired_one_is_forgotten():
    router = make_router(3, scoring_profile="locality")
    assert router.on_events(KVEventBatch(1, 0, stored(1, 2)))
    router.route("a", 32, [h(1), h(2)])
    assert router.stats().replicas[1].load_tokens == 32
    router.set_draining(1)
    assert router.live_replicas() == [0, 2]
    assert router.route("b", 32, [h(1), h(2)]).replica_index != 1
    # Still indexed and still reporting while it drains.
    assert router.on_events(KVEventBatch(1, 2, stored(3)))
    assert router.stats().replicas[1].num_indexed_blocks_in(Tier.NPU) == 3
    router.add_generated("a", 4)
    assert router.stats().replicas[1].load_tokens == 36
    router.retire(1)
    assert [r.replica_index for r in router.stats().replicas] == [0, 2]
    router.mark_alive(1)  # a late health report cannot bring it back
    assert router.live_replicas() == [0, 2]
    assert not router.on_events(KVEventBatch(1, 3, stored(4)))
    with pytest.raises(ValueError, match="retired"):
        router.start_routing(1)
    assert router.add_replica() == 3  # the next unused index, never 1 again
    router.check_integrity()


def test_no_routable_replica_raises_while_every_one_drains():
    router = make_router(1)
    router.set_draining(0)
    with pytest.raises(NoLiveReplicaError):
        router.route("a", 16, [])


def test_a_new_replica_ramps_up_on_cold_prompts_only():
    clock = Clock()
    router = make_router(1, clock=clock, ramp_s=30.0)
    router.route("busy", 1000, [])  # replica 0 carries 1000 tokens
    router.add_replica()
    router.start_routing(1)
    # At the ramp's start the new replica looks busier than the busiest one: cold prompts stay.
    assert router.route("cold-1", 100, []).replica_index == 0
    router.release("cold-1")
    # A prompt it caches goes to it at once.
    assert router.on_events(KVEventBatch(1, 0, stored(7, 8)))
    assert router.route("warm", 32, [h(7), h(8)]).replica_index == 1
    router.release("warm")
    # Past the ramp it is scored on its own load: the idle replica takes the cold prompt.
    clock.now = 31.0
    assert router.route("cold-2", 100, []).replica_index == 1
    router.check_integrity()


def test_midway_through_the_ramp_the_penalty_is_proportional():
    clock = Clock()
    router = make_router(1, clock=clock, ramp_s=10.0, scoring_profile="load")
    router.route("busy", 300, [])
    router.add_replica()
    router.start_routing(1)
    clock.now = 5.0  # half the ramp left: penalty 0.5 * (300 + 100) = 200 < 300
    assert router.route("cold", 100, []).replica_index == 1


def test_sync_members_restores_a_resized_deployment_after_a_restart():
    router = make_router(2)  # as Ray re-creates it: the start-up size
    router.sync_members(["retired", "serving", "draining", "joining"], ["n0", "n0", "n1", "n1"])
    assert router.num_replicas == 4
    assert router.roles() == [
        ReplicaRole.RETIRED,
        ReplicaRole.SERVING,
        ReplicaRole.DRAINING,
        ReplicaRole.JOINING,
    ]
    assert router.live_replicas() == [1]
    assert [r.replica_index for r in router.stats().replicas] == [1, 2, 3]
    router.check_integrity()


def test_events_of_a_replica_the_router_has_not_heard_of_are_refused():
    router = make_router(2)
    assert not router.on_events(KVEventBatch(5, 0, stored(1)))


@pytest.mark.parametrize("start", [7, 8, 15])
def test_the_prefix_index_grows_across_lanes_and_keeps_every_entry(start):
    index = PrefixIndex(start)
    for replica in range(start):
        index.apply(KVEventBatch(replica, 0, stored(replica, 100)))
        index.apply(KVEventBatch(replica, 1, stored(replica + 1000, tier="host")))
    before = index.match([h(100)], range(start))
    for _ in range(3):
        index.add_replica()
    assert index.num_replicas == start + 3
    index.check_integrity()
    assert index.match([h(100)], range(start))[:start] == before
    new = start + 2
    index.apply(KVEventBatch(new, 0, stored(100)))
    matches = index.match([h(100)], range(start + 3))
    assert [m.num_blocks for m in matches] == [1] * start + [0, 0, 1]
    assert index.num_host_blocks(start - 1) == 1
    index.check_integrity()


def test_the_disk_index_grows_and_a_new_replica_reads_its_nodes_disk():
    disk = BackingIndex(Tier.DISK, 2)
    disk.set_nodes(["a", "b"])
    disk.apply(KVEventBatch(0, 0, stored(1, 2, tier="disk")))
    assert disk.add_replica("a") == 2
    assert disk.extend([h(1), h(2)], 0, 2) == 2  # replica 0's blocks, on node a
    assert disk.add_replica("b") == 3
    assert disk.extend([h(1), h(2)], 0, 3) == 0
    disk.load_snapshot(KVSnapshot(3, 0, {}))
    disk.check_integrity()
