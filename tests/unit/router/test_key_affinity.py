"""``prompt_cache_key`` affinity: one key stays on one replica while the load rule allows."""

import pytest

from router.affinity import KeyAffinity
from router.config import RoutingConfig
from router.router import Router

BLOCK = 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_router(num_replicas: int = 2, **config) -> Router:
    return Router(num_replicas, BLOCK, RoutingConfig(**config))


def test_requests_with_one_key_stay_on_one_replica():
    router = make_router(2)
    first = router.route("a", 64, [h(1), h(2)], cache_key="k")
    assert first.replica_index == 0 and not first.is_key_affinity
    # Without a key the second request would go to the idle replica 1 (load term).
    second = router.route("b", 64, [h(7), h(8)], cache_key="k")
    assert second.replica_index == 0 and second.is_key_affinity
    assert second.prefix_score == 1.0 and second.num_matched_tokens == 0  # credit, not a match
    other = router.route("c", 64, [h(9)], cache_key="other")
    assert other.replica_index == 1
    assert [r.num_key_affinity_routes for r in router.stats().replicas] == [1, 0]
    router.check_integrity()


def test_without_a_key_the_same_requests_spread():
    router = make_router(2)
    assert router.route("a", 64, [h(1), h(2)]).replica_index == 0
    assert router.route("b", 64, [h(7), h(8)]).replica_index == 1


def test_the_key_yields_when_its_replica_is_overloaded_and_then_follows():
    router = make_router(2)  # key_overload_factor 2: load + P > 2 x (least + P)
    for n in range(2):  # 64, then 128 tokens on replica 0; replica 1 idle
        assert router.route(f"k{n}", 64, [], cache_key="k").replica_index == 0
    # 128 + 64 > 2 x (0 + 64): overloaded, so the request is scored as without a key.
    yielded = router.route("k2", 64, [], cache_key="k")
    assert yielded.replica_index == 1 and not yielded.is_key_affinity
    # The key moved with it: replica 1 now carries 64, 64 + 64 <= 2 x (64 + 64).
    assert router.route("k3", 64, [], cache_key="k").replica_index == 1
    router.check_integrity()


def test_a_higher_overload_factor_holds_the_key_longer():
    router = make_router(2, key_overload_factor=4.0)
    for n in range(4):  # 3 x 64 + 64 <= 4 x 64 holds up to the fourth request
        assert router.route(f"k{n}", 64, [], cache_key="k").replica_index == 0
    assert router.route("k4", 64, [], cache_key="k").replica_index == 1


def test_a_dead_replica_loses_its_keys():
    router = make_router(3)
    assert router.route("a", 64, [], cache_key="k").replica_index == 0
    router.mark_dead(0)
    decision = router.route("b", 64, [], cache_key="k")
    assert decision.replica_index == 1 and not decision.is_key_affinity


def test_max_cache_keys_zero_ignores_keys():
    router = make_router(2, max_cache_keys=0)
    assert router.route("a", 64, [], cache_key="k").replica_index == 0
    assert router.route("b", 64, [], cache_key="k").replica_index == 1


def test_the_affinity_map_forgets_the_least_recently_used_key():
    affinity = KeyAffinity(2)
    affinity.record("a", 0)
    affinity.record("b", 1)
    affinity.record("a", 2)  # a is the most recent now
    affinity.record("c", 1)
    assert len(affinity) == 2
    assert (affinity.replica_of("a"), affinity.replica_of("b"), affinity.replica_of("c")) == (
        2,
        None,
        1,
    )
    affinity.clear_replica(1)
    assert affinity.replica_of("c") is None and affinity.replica_of("a") == 2


@pytest.mark.parametrize(
    ("option", "value"), [("key_overload_factor", 0.5), ("max_cache_keys", -1)]
)
def test_bad_key_options_name_themselves(option, value):
    with pytest.raises(ValueError, match=f"routing.{option}"):
        RoutingConfig(**{option: value})


def test_round_robin_ignores_keys():
    router = make_router(2, policy="round-robin")
    replicas = [router.route(f"r{n}", 64, [], cache_key="k").replica_index for n in range(4)]
    assert replicas == [0, 1, 0, 1]
