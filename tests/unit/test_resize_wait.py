"""A scale-out that needs more than the Ray cluster can place now (``cluster.resize``): refused at
once on a Ray local to one machine or with ``ray.scale_out_wait_s`` at 0; on a cluster that can
grow, its bundles wait that long for Ray, then it is refused, the deployment as it was. Fakes
stand for Ray: the waiting itself on a real cluster is ``tests/integration/test_resize_wait.py``.
"""

import asyncio
import logging
import re
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from cluster.cli import one_line
from cluster.config import ClusterConfig
from cluster.placement import PLACEMENT_TIMEOUT_S, PlacementTimeout
from cluster.resize import Resizer


class FakePlacement:
    """Room for ``placeable`` more replicas now; ``reserve`` records its call and times out."""

    def __init__(self, placeable: float) -> None:
        self.bundle = {"CPU": 1.0}
        self.placeable = placeable
        self.reserved: list[tuple[list[int], float]] = []

    def num_placeable(self) -> float:
        return self.placeable

    def describe_shortfall(self, num_new: int) -> str:
        return f"{num_new} more replica(s) need {self.bundle} each"

    async def reserve(self, indices: list[int], timeout_s: float) -> None:
        self.reserved.append((list(indices), timeout_s))
        raise PlacementTimeout(f"Ray placed 0 of {len(indices)} new placement group(s)")


def resizer(placement: FakePlacement, can_grow: bool, wait_s: float) -> Resizer:
    config = ClusterConfig.model_validate(
        {"data_parallel_size": 2, "ray": {"scale_out_wait_s": wait_s}}
    )
    members = SimpleNamespace(target_size=2, replicas=["replica-0", "replica-1"])

    def never(*args: object) -> None:
        raise AssertionError("no replica starts or stops")

    return Resizer(
        config, members, placement, None, None, never, never, lambda c, n: None, can_grow=can_grow
    )


def assert_unchanged(scaling: Resizer) -> None:
    assert scaling.membership.target_size == 2
    assert scaling.membership.replicas == ["replica-0", "replica-1"]
    assert scaling.config.data_parallel_size == 2
    assert scaling.num_scale_events == {"out": 0, "in": 0}


@pytest.mark.parametrize(
    ("can_grow", "wait_s", "why"),
    [
        (False, 600.0, "this Ray instance is local to one machine and cannot grow"),
        (True, 0.0, "ray.scale_out_wait_s is 0, so a scale-out does not wait for it to grow"),
    ],
)
def test_a_ray_that_cannot_grow_or_a_wait_of_zero_refuses_at_once(can_grow, wait_s, why):
    placement = FakePlacement(placeable=1)
    scaling = resizer(placement, can_grow, wait_s)
    expected = f"data_parallel_size 4 is more than the Ray cluster can place, and {why}: 2 more"
    with pytest.raises(ValueError, match=re.escape(expected)):
        asyncio.run(scaling.scale(4))
    assert placement.reserved == []  # nothing reserved, nothing waited for
    assert_unchanged(scaling)


def test_a_cluster_that_can_grow_waits_the_bound_then_refuses_naming_the_option(caplog):
    placement = FakePlacement(placeable=0)
    scaling = resizer(placement, can_grow=True, wait_s=5.0)
    with (
        caplog.at_level(logging.INFO, logger="cluster.resize"),
        pytest.raises(ValueError) as refused,
    ):
        asyncio.run(scaling.scale(3))
    assert placement.reserved == [([2], 5.0)]
    assert str(refused.value) == (
        "data_parallel_size 3: the Ray cluster did not grow to place 1 more replica(s) within "
        "ray.scale_out_wait_s (5 s): Ray placed 0 of 1 new placement group(s)"
    )
    waits = [r.getMessage() for r in caplog.records if "wait up to" in r.getMessage()]
    assert len(waits) == 1 and "1 more replica(s) need {'CPU': 1.0} each" in waits[0]
    assert "up to 5 s (ray.scale_out_wait_s)" in waits[0]
    assert_unchanged(scaling)


@pytest.mark.parametrize(
    ("can_grow", "wait_s", "timeout_s"),
    [(False, 600.0, PLACEMENT_TIMEOUT_S), (True, 600.0, 600.0), (True, 5.0, PLACEMENT_TIMEOUT_S)],
)
def test_a_scale_out_that_fits_now_logs_no_wait_and_is_bounded_alike(
    can_grow, wait_s, timeout_s, caplog
):
    placement = FakePlacement(placeable=2)
    scaling = resizer(placement, can_grow=can_grow, wait_s=wait_s)
    with (
        caplog.at_level(logging.INFO, logger="cluster.resize"),
        pytest.raises(ValueError, match=r"^data_parallel_size 4: Ray placed 0 of 2"),
    ):
        asyncio.run(scaling.scale(4))
    assert placement.reserved == [([2, 3], timeout_s)]
    assert not [r for r in caplog.records if "wait up to" in r.getMessage()]
    assert_unchanged(scaling)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "ray.scale_out_wait_s: Input should be greater than or equal to 0"),
        ("nan", "ray.scale_out_wait_s: Input should be a finite number"),
        ("soon", "ray.scale_out_wait_s: Input should be a valid number"),
    ],
)
def test_a_bad_wait_is_refused_at_start_up_in_one_sentence_naming_the_option(value, message):
    with pytest.raises(ValidationError) as error:
        ClusterConfig.model_validate({"ray": {"scale_out_wait_s": value}})
    assert one_line(error.value).startswith(message)
    assert ClusterConfig().ray.scale_out_wait_s == 600.0
