"""Default replica sizing: a deployment's replicas share the Ray cluster's CPUs."""

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
