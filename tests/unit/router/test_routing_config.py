import pytest
from pydantic import ValidationError

from router.config import SCORING_PROFILES, RoutingConfig


def test_defaults_are_scoring_balanced_with_host_hits_at_nine_tenths():
    config = RoutingConfig()
    assert config.policy == "scoring"
    assert config.scoring_profile == "balanced"
    assert config.weights == (0.55, 0.45)
    assert config.host_hit_weight == 0.9
    assert config.enable_prefix_caching


@pytest.mark.parametrize(
    ("profile", "weights"),
    [("balanced", (0.55, 0.45)), ("locality", (0.90, 0.10)), ("load", (0.10, 0.90))],
)
def test_named_profiles_give_their_weights(profile, weights):
    assert RoutingConfig(scoring_profile=profile).weights == weights
    assert SCORING_PROFILES[profile] == weights


def test_custom_profile_uses_the_explicit_weights():
    config = RoutingConfig(scoring_profile="custom", prefix_weight=0.7, load_weight=0.0)
    assert config.weights == (0.7, 0.0)


@pytest.mark.parametrize("profile", ["balanced", "locality", "load"])
def test_prefix_caching_off_means_the_load_profile(profile):
    config = RoutingConfig(scoring_profile=profile, enable_prefix_caching=False)
    assert config.weights == (0.10, 0.90)
    custom = RoutingConfig(
        scoring_profile="custom", prefix_weight=1.0, load_weight=0.0, enable_prefix_caching=False
    )
    assert custom.weights == (0.10, 0.90)


def test_round_robin_with_the_default_profile_is_valid():
    assert RoutingConfig(policy="round-robin").policy == "round-robin"


@pytest.mark.parametrize(
    ("kwargs", "options"),
    [
        (
            {"policy": "round-robin", "scoring_profile": "locality"},
            ["--data-parallel-scoring-profile", "--data-parallel-routing-policy round-robin"],
        ),
        (
            {
                "policy": "round-robin",
                "scoring_profile": "custom",
                "prefix_weight": 1.0,
                "load_weight": 1.0,
            },
            ["--data-parallel-scoring-profile", "--data-parallel-routing-policy round-robin"],
        ),
        ({"prefix_weight": 0.5}, ["--data-parallel-prefix-weight", "custom"]),
        ({"scoring_profile": "load", "load_weight": 0.5}, ["--data-parallel-load-weight"]),
        ({"scoring_profile": "custom", "prefix_weight": 0.5}, ["--data-parallel-load-weight"]),
        ({"scoring_profile": "custom", "load_weight": 0.5}, ["--data-parallel-prefix-weight"]),
        (
            {"scoring_profile": "custom", "prefix_weight": -0.1, "load_weight": 1.0},
            ["--data-parallel-prefix-weight", "non-negative"],
        ),
        (
            {"scoring_profile": "custom", "prefix_weight": 1.0, "load_weight": float("nan")},
            ["--data-parallel-load-weight"],
        ),
        (
            {"scoring_profile": "custom", "prefix_weight": 0.0, "load_weight": 0.0},
            ["--data-parallel-prefix-weight", "--data-parallel-load-weight", "both be zero"],
        ),
        ({"host_hit_weight": 1.5}, ["--data-parallel-host-hit-weight"]),
        ({"host_hit_weight": -0.5}, ["--data-parallel-host-hit-weight"]),
        ({"overload_factor": 0.5}, ["routing.overload_factor", "0 or at least 1"]),
        ({"overload_factor": float("inf")}, ["routing.overload_factor"]),
    ],
)
def test_invalid_configurations_name_the_option(kwargs, options):
    with pytest.raises(ValidationError) as error:
        RoutingConfig(**kwargs)
    message = str(error.value)
    for option in options:
        assert option in message


@pytest.mark.parametrize(
    "kwargs", [{"policy": "random"}, {"scoring_profile": "cache"}, {"unknown_field": 1}]
)
def test_unknown_values_and_fields_are_rejected(kwargs):
    with pytest.raises(ValidationError):
        RoutingConfig(**kwargs)
