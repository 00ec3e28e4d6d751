"""The scale-in victim choice (``cluster.scaling``): exact losses on constructed cases."""

import math
import random

import pytest

from cluster.scaling import (
    ReplicaValue,
    choose_random_victims,
    choose_victims,
    replica_losses,
)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def value(index: int, blocks: dict[int, float], node: str = "n", load: int = 0) -> ReplicaValue:
    return ReplicaValue(index, node, {h(b): w for b, w in blocks.items()}, load)


def test_the_loss_counts_only_blocks_no_other_replica_holds():
    replicas = [
        value(0, {1: 5.0, 2: 1.0}),
        value(1, {2: 3.0, 3: 0.5}),
        value(2, {4: 2.0}),
    ]
    assert replica_losses(replicas, {}) == {0: 5.0, 1: 0.5, 2: 2.0}
    (choice,) = choose_victims(replicas, 1)
    assert choice.replica_index == 1 and choice.loss == 0.5
    assert choice.losses == {0: 5.0, 1: 0.5, 2: 2.0}
    assert "least" in choice.reason


def test_a_block_on_the_shared_disk_is_not_lost_while_a_survivor_shares_the_node():
    replicas = [value(0, {1: 9.0}, node="a"), value(1, {2: 1.0}, node="a"), value(2, {3: 4.0}, "b")]
    disk = {"a": {h(1)}, "b": {h(3)}}
    # Replica 0's hot block is on node a's disk, and replica 1 stays on node a; replica 2 is
    # alone on node b, so its node's disk does not help the cluster.
    assert replica_losses(replicas, disk) == {0: 0.0, 1: 1.0, 2: 4.0}
    assert choose_victims(replicas, 1, disk)[0].replica_index == 0


def test_ties_go_to_the_least_loaded_then_the_highest_index():
    replicas = [value(0, {}, load=10), value(1, {}, load=5), value(2, {}, load=5)]
    first, second = choose_victims(replicas, 2)
    assert (first.replica_index, second.replica_index) == (2, 1)
    assert "highest index" in first.reason
    assert "least loaded" in second.reason


def test_removing_several_recomputes_the_losses_among_those_staying():
    # 0 and 1 share block 1 (weight 10): removing one of them loses nothing, both loses it.
    replicas = [value(0, {1: 10.0}), value(1, {1: 10.0}), value(2, {2: 3.0})]
    first, second = choose_victims(replicas, 2)
    assert first.replica_index == 1 and first.loss == 0.0
    assert second.replica_index == 2 and second.loss == 3.0  # 0 now alone holds block 1


def test_a_silent_replica_is_kept_and_one_must_stay():
    replicas = [
        ReplicaValue(0, "n", {}, 0, is_reachable=False),
        value(1, {1: 1.0}),
    ]
    assert math.isinf(replica_losses(replicas, {})[0])
    assert choose_victims(replicas, 1)[0].replica_index == 1
    with pytest.raises(ValueError, match="at least one must stay"):
        choose_victims(replicas, 2)


def test_the_random_baseline_draws_distinct_replicas_and_reports_their_losses():
    replicas = [value(0, {1: 5.0}), value(1, {2: 1.0}), value(2, {3: 2.0})]
    first, second = choose_random_victims(replicas, 2, rng=random.Random(4))
    expected = random.Random(4)  # the same draws: an index into those still staying
    staying = [0, 1, 2]
    drawn = [staying.pop(expected.randrange(3)), staying.pop(expected.randrange(2))]
    assert [first.replica_index, second.replica_index] == drawn
    assert first.losses == {0: 5.0, 1: 1.0, 2: 2.0}
    assert first.loss == first.losses[first.replica_index]
    assert first.reason == "drawn at random"
    with pytest.raises(ValueError, match="at least one must stay"):
        choose_random_victims(replicas, 3)
