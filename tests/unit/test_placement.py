"""Default replica sizing: a deployment's replicas share the Ray cluster's CPUs."""

import asyncio
from types import SimpleNamespace

import pytest

from cluster import placement
from cluster.config import RayConfig


@pytest.fixture
def cluster(monkeypatch):
    """A fake Ray cluster: ``cluster(available, node_cpus...)``."""

    def _set(available: float, *node_cpus: float) -> None:
        nodes = [{"Alive": True, "Resources": {"CPU": cpus}} for cpus in node_cpus]
        monkeypatch.setattr(placement.ray, "available_resources", lambda: {"CPU": available})
        monkeypatch.setattr(placement.ray, "nodes", lambda: nodes)

    return _set


@pytest.mark.parametrize(
    ("available", "nodes", "replicas", "expected"),
    [
        (2, [2], 1, 2.0),  # one replica takes the whole small machine
        (2, [2], 2, 1.0),
        (2, [2], 4, 0.5),  # fewer CPUs than replicas: fractions, one thread each
        (3, [3], 2, 1.0),  # whole CPUs only: 1.5 would buy no second thread
        (16, [16], 2, 7.0),  # a large machine keeps one CPU for the front: 15 / 2
        (16, [16], 1, 15.0),
        (8, [4, 4], 1, 4.0),  # never more than one node holds
        (1.5, [2], 1, 1.0),  # what other deployments left
    ],
)
def test_unset_cpus_per_replica_shares_the_available_cpus(
    cluster, available, nodes, replicas, expected
):
    cluster(available, *nodes)
    assert placement.cpus_per_replica(RayConfig(), 0.0, replicas) == expected


def test_an_explicit_setting_wins_and_gpu_replicas_take_one_cpu(cluster):
    cluster(16, 16)
    assert placement.cpus_per_replica(RayConfig(cpus_per_replica=0.25), 0.0, 2) == 0.25
    assert placement.cpus_per_replica(RayConfig(cpus_per_replica=0), 1.0, 2) == 0.0
    assert placement.cpus_per_replica(RayConfig(), 1.0, 2) == 1.0


class FakeGroup:
    def __init__(self, num_bundles: int) -> None:
        self.bundle_specs = [{"CPU": 0.5}] * num_bundles


def test_a_scale_out_counts_free_bundles_and_what_fits(cluster, monkeypatch):
    removed: list[FakeGroup] = []
    monkeypatch.setattr(placement, "remove_placement_group", removed.append)
    start = FakeGroup(2)
    replicas = placement.ReplicaPlacement(start, 0.5, 0.0, {})
    assert replicas.bundles == {0: (start, 0), 1: (start, 1)}
    cluster(1.2, 2)  # 1.2 CPUs free: two more bundles of 0.5
    assert replicas.num_placeable() == 2
    replicas.release(1)  # its bundle is free; the start-up group still holds replica 0
    assert replicas.num_placeable() == 3 and removed == []
    assert "1 free bundle" in replicas.describe_shortfall(4)
    replicas.release(0)  # no replica left in the group: it is removed
    assert removed == [start] and replicas.free == []
    cluster(8.0, 0.25)  # no node could hold a bundle
    assert replicas.num_placeable() == 0


class PendingGroup(FakeGroup):
    """A one-bundle group Ray places when ``placed`` (else it stays pending)."""

    def __init__(self, placed: bool) -> None:
        super().__init__(1)
        self.placed = placed

    async def ready(self) -> None:
        if not self.placed:
            await asyncio.Event().wait()


def test_reserve_waits_for_new_groups_together_and_gives_all_back_when_not_placed(
    cluster, monkeypatch
):
    removed: list[FakeGroup] = []
    monkeypatch.setattr(placement, "remove_placement_group", removed.append)
    outcomes = iter([True, False])  # the first new group is placed, the second is not
    created: list[PendingGroup] = []

    def new_group(bundles, strategy):
        created.append(PendingGroup(next(outcomes)))
        return created[-1]

    monkeypatch.setattr(placement, "placement_group", new_group)
    cluster(0.0, 1)
    start = FakeGroup(2)
    replicas = placement.ReplicaPlacement(start, 0.5, 0.0, {})
    replicas.release(1)  # a free bundle in the start-up group
    with pytest.raises(placement.PlacementTimeout, match="Ray placed 1 of 2 new placement group"):
        asyncio.run(replicas.reserve([2, 3, 4], timeout_s=0.2))
    # the free bundle is free again, both new groups (placed or not) removed
    assert replicas.bundles == {0: (start, 0)} and replicas.free == [(start, 1)]
    assert removed == created
    created.clear()
    outcomes = iter([True])
    asyncio.run(replicas.reserve([5, 6], timeout_s=0.2))  # the free bundle and one new group
    assert replicas.bundles == {0: (start, 0), 5: (start, 1), 6: (created[0], 0)}


def test_only_a_ray_joined_by_address_can_grow(monkeypatch):
    monkeypatch.setattr(placement.ray, "is_initialized", lambda: False)
    assert not placement.can_grow(RayConfig())  # init_ray starts the embedded one
    assert placement.can_grow(RayConfig(address="ray-head:6379"))
    monkeypatch.setattr(placement.ray, "is_initialized", lambda: True)
    worker = placement.ray._private.worker
    monkeypatch.setattr(worker, "_global_node", SimpleNamespace(head=True))
    assert not placement.can_grow(RayConfig(address="ray-head:6379"))  # this process started it
    monkeypatch.setattr(worker, "_global_node", SimpleNamespace(head=False))
    assert placement.can_grow(RayConfig())  # this process joined it
    monkeypatch.setattr(worker, "_global_node", None)
    assert placement.can_grow(RayConfig())  # a Ray Client
