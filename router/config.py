"""Configuration of routing: which policy picks a replica and how scoring weighs cache and load.

Validated at start-up, before anything runs; each rule names the CLI option it checks, so a bad
configuration fails with one sentence that says what to change. ``cluster.config.ClusterConfig``
composes this model and passes ``enable_prefix_caching`` from the replicas' prefix-cache switch.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.kv.events import Tier, backing_tiers, tiers

SCORING_PROFILES: dict[str, tuple[float, float]] = {
    "balanced": (0.55, 0.45),
    "locality": (0.90, 0.10),
    "load": (0.10, 0.90),
}
"""Named ``(prefix_weight, load_weight)`` pairs of ``--data-parallel-scoring-profile``."""

DEFAULT_SCORING_PROFILE = "balanced"

DEFAULT_HOST_HIT_WEIGHT = 0.9
"""A host-only matched block counts 0.9 of an NPU-matched one: reloading a block costs a small
fraction of recomputing it, and with 0.5 the load term moved sessions away from their reloadable
prefix. Figures: ``benchmarks/README.md``, section "Strata's router: pending prompts, host hits
at 0.9, load as a share", item 2."""

DEFAULT_DISK_HIT_WEIGHT = 0.7
"""A block only the replica's node disk holds counts 0.7 of an NPU-matched one: a disk read into
host and the load from there took 1.4-2.0x a host hit's time on ``reload-vs-recompute``, still a
small fraction of recomputing (``benchmarks/README.md``, the disk columns)."""


DEFAULT_KEY_OVERLOAD_FACTOR = 2.0
"""A key's replica keeps the key's requests until it carries twice the least loaded replica's
active tokens (each with the new prompt added): the prompt's own size is the floor, so two
concurrent requests of one key stay together on an otherwise idle cluster."""

DEFAULT_OVERLOAD_FACTOR = 16.0
"""No request is routed to a replica carrying more than 16 times the least loaded replica's
active tokens (each with the new prompt added), however much of its prompt it caches. Without
it, sessions behind a few hot shared prefixes piled up on their holders at dp 32-64 (load 14-25
times the mean) and the cluster finished 16.7 and 22.6 of 24.8 and 49 requests/s offered; at 16
the trace simulator's hit rates moved by at most 0.003 on the Mooncake traces. Figures:
``benchmarks/README.md``, section "An overload bound for the scoring router"."""


class TTFTCosts(BaseModel):
    """What the ``ttft`` scoring profile predicts a request's time to first token from, in
    seconds per unit of the router's tokens and blocks (the shape of the simulator's cost
    model: ``benchmarks/sim/cost_model.py``)."""

    model_config = ConfigDict(extra="forbid")

    step_s: float = Field(0.0, ge=0, description="Fixed time of one engine step.")
    prefill_s_per_token: float = Field(..., ge=0, description="Prefill time per prompt token.")
    prefill_s_per_token_context: float = Field(
        0.0, ge=0, description="Prefill attention time per token and context token."
    )
    decode_s_per_seq: float = Field(0.0, ge=0, description="A step's time per running sequence.")
    decode_s_per_context_token: float = Field(
        0.0, ge=0, description="A step's time per context token of its running sequences."
    )
    reload_s_per_block: float = Field(0.0, ge=0, description="Host -> NPU time of one block.")
    disk_reload_s_per_block: float = Field(
        0.0, ge=0, description="Disk -> host -> NPU time of one block on the replica's node."
    )
    tier_reload_s_per_block: dict[str, float] = Field(
        default_factory=dict,
        description="routing.ttft_costs.tier_reload_s_per_block: the time of one block read "
        "from a backing tier other than disk into host and loaded to the NPU, by tier name (a "
        "tier left out costs disk_reload_s_per_block).",
    )
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Tokens one engine step computes at most (its scheduler's)."
    )
    forfeit_weight: float = Field(
        0.0,
        ge=0,
        description="Adds this many times the prefill time of the cached tokens a replica "
        "lacks against the best-cached one: the reuse a placement away from its prefix "
        "forfeits for the prompt's later turns.",
    )
    slack: float = Field(
        0.0,
        ge=0,
        description="Among replicas predicted within (1 + slack) x the lowest TTFT, the one "
        "caching the longest prefix wins (0: the lowest TTFT wins).",
    )

    @model_validator(mode="after")
    def _check(self) -> "TTFTCosts":
        option = "routing.ttft_costs.tier_reload_s_per_block"
        backing = [t for t in backing_tiers() if t != Tier.DISK]
        for name, cost in self.tier_reload_s_per_block.items():
            if name not in backing:
                raise ValueError(
                    f"{option} names {name!r}, which is not a registered backing KV tier other "
                    f"than disk (those are: {_names(backing)})"
                )
            if not (math.isfinite(cost) and cost >= 0):
                raise ValueError(f"{option}[{name!r}] must be a non-negative number, got {cost}")
        return self

    def reload_s_per_block_of(self, tier: Tier) -> float:
        """The time to bring one block of ``tier`` to the NPU: none for the NPU, host's
        ``reload_s_per_block`` for a pooled tier, disk's for disk and for a backing tier that
        ``tier_reload_s_per_block`` leaves out."""
        if tier == Tier.NPU:
            return 0.0
        if Tier(tier).traits.pooled:
            return self.reload_s_per_block
        return self.tier_reload_s_per_block.get(tier, self.disk_reload_s_per_block)


class RoutingConfig(BaseModel):
    """How the router picks a data-parallel replica for each request (DESIGN section 6).

    Invariants after validation: ``round-robin`` only with the default profile; explicit weights
    only with the ``custom`` profile, where both are set, finite, non-negative and not both zero;
    ``0 <= host_hit_weight <= 1``. ``weights`` is the pair scoring actually uses.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    policy: Literal["scoring", "round-robin"] = Field(
        "scoring",
        description="--data-parallel-routing-policy: score replicas by cached prefix and load, "
        "or cycle over live replicas.",
    )
    scoring_profile: Literal["balanced", "locality", "load", "custom", "ttft"] = Field(
        DEFAULT_SCORING_PROFILE,
        description="--data-parallel-scoring-profile: prefix/load weights balanced 0.55/0.45, "
        "locality 0.90/0.10, load 0.10/0.90, or custom (set both weights); or ttft: the "
        "lowest predicted time to first token, priced with ttft_costs.",
    )
    ttft_costs: TTFTCosts | None = Field(
        None,
        description="The cost profile of the ttft scoring profile; without one, a deployment "
        "measures it on its replicas at start-up (replicas.calibration).",
    )
    prefix_weight: float | None = Field(
        None,
        description="--data-parallel-prefix-weight: weight of the prefix score; custom profile "
        "only.",
    )
    load_weight: float | None = Field(
        None,
        description="--data-parallel-load-weight: weight of the load score; custom profile only.",
    )
    host_hit_weight: float = Field(
        DEFAULT_HOST_HIT_WEIGHT,
        description="--data-parallel-host-hit-weight: what a host-only matched block counts for "
        "in the prefix score, as a fraction of an NPU-matched block (0 to 1).",
    )
    disk_hit_weight: float = Field(
        DEFAULT_DISK_HIT_WEIGHT,
        description="--data-parallel-disk-hit-weight: what a block only the replica's node disk "
        "tier holds counts for in the prefix score, as a fraction of an NPU-matched block "
        "(0 to 1).",
    )
    peer_pull_min_blocks: int = Field(
        4,
        ge=0,
        description="routing.peer_pull_min_blocks: when another replica holds at least this "
        "many more blocks of a prompt's prefix in its NPU and host tiers than the chosen one, "
        "and pulling them beats computing them at the costs the chosen replica reports "
        "(router.peer_sources), the router names it as the source the chosen replica pulls "
        "them from (replicas.kv.tiers.peer); 0 turns pulling off. A deployment whose replicas "
        "lack the peer tier names none.",
    )
    tier_hit_weights: dict[str, float] = Field(
        default_factory=dict,
        description="routing.tier_hit_weights: what a matched block only another registered "
        "tier holds counts for in the prefix score, by tier name (0 to 1); a tier left out "
        "counts its registered hit_weight. Host and disk take theirs from their own options.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Whether replicas cache prefixes (--no-enable-prefix-caching turns it off); "
        "when off, scoring uses the load profile whatever the profile says.",
    )
    key_overload_factor: float = Field(
        DEFAULT_KEY_OVERLOAD_FACTOR,
        description="routing.key_overload_factor: requests with one prompt_cache_key stay on "
        "the key's replica until its active tokens (this prompt added) exceed this many times "
        "the least loaded live replica's (this prompt added); at least 1.",
    )
    overload_factor: float = Field(
        DEFAULT_OVERLOAD_FACTOR,
        description="routing.overload_factor: the scoring policy leaves out every replica whose "
        "active tokens (this prompt added) exceed this many times the least loaded live "
        "replica's (this prompt added), however much of the prompt it caches; at least 1, or 0 "
        "for no bound.",
    )
    max_cache_keys: int = Field(
        65536,
        description="routing.max_cache_keys: prompt_cache_key values the router remembers "
        "(least recently used forgotten first); 0 ignores keys.",
    )

    ramp_s: float = Field(
        30.0,
        ge=0,
        description="routing.ramp_s: a replica added to a running deployment takes a share of "
        "new (cold) prefixes that grows to its full share over this many seconds (0: at once).",
    )

    @model_validator(mode="after")
    def _check(self) -> "RoutingConfig":
        if self.policy == "round-robin" and self.scoring_profile != DEFAULT_SCORING_PROFILE:
            raise ValueError(
                f"--data-parallel-scoring-profile {self.scoring_profile} cannot be used with "
                "--data-parallel-routing-policy round-robin; drop the profile or use scoring"
            )
        has_weights = self.prefix_weight is not None or self.load_weight is not None
        if self.scoring_profile != "custom" and has_weights:
            raise ValueError(
                "--data-parallel-prefix-weight and --data-parallel-load-weight need "
                "--data-parallel-scoring-profile custom"
            )
        if self.scoring_profile == "custom":
            _check_custom_weights(self.prefix_weight, self.load_weight)
        if not (0.0 <= self.disk_hit_weight <= 1.0):
            raise ValueError(
                f"--data-parallel-disk-hit-weight must be between 0 and 1, "
                f"got {self.disk_hit_weight}"
            )
        if not (math.isfinite(self.key_overload_factor) and self.key_overload_factor >= 1.0):
            raise ValueError(
                f"routing.key_overload_factor must be at least 1, got {self.key_overload_factor}"
            )
        factor = self.overload_factor
        if not (factor == 0.0 or (math.isfinite(factor) and factor >= 1.0)):
            raise ValueError(f"routing.overload_factor must be 0 or at least 1, got {factor}")
        if self.max_cache_keys < 0:
            raise ValueError(
                f"routing.max_cache_keys must be non-negative, got {self.max_cache_keys}"
            )
        if not (0.0 <= self.host_hit_weight <= 1.0):
            raise ValueError(
                f"--data-parallel-host-hit-weight must be between 0 and 1, "
                f"got {self.host_hit_weight}"
            )
        _check_tier_hit_weights(self.tier_hit_weights)
        return self

    @property
    def needs_ttft_costs(self) -> bool:
        """The ttft profile is in effect but has no cost profile yet: the deployment measures
        one at start-up and hands it to the router (``Router.set_ttft_costs``)."""
        return (
            self.policy == "scoring"
            and self.scoring_profile == "ttft"
            and self.enable_prefix_caching
            and self.ttft_costs is None
        )

    @property
    def weights(self) -> tuple[float, float]:
        """``(prefix_weight, load_weight)`` in effect: the ``load`` profile when prefix caching
        is off, the explicit weights for ``custom``, else the named profile's pair."""
        if not self.enable_prefix_caching:
            return SCORING_PROFILES["load"]
        if self.scoring_profile == "custom":
            assert self.prefix_weight is not None and self.load_weight is not None
            return (self.prefix_weight, self.load_weight)
        return SCORING_PROFILES.get(self.scoring_profile, SCORING_PROFILES[DEFAULT_SCORING_PROFILE])


def _check_custom_weights(prefix_weight: float | None, load_weight: float | None) -> None:
    for option, value in (
        ("--data-parallel-prefix-weight", prefix_weight),
        ("--data-parallel-load-weight", load_weight),
    ):
        if value is None:
            raise ValueError(f"--data-parallel-scoring-profile custom needs {option}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{option} must be a non-negative number, got {value}")
    if prefix_weight == 0 and load_weight == 0:
        raise ValueError(
            "--data-parallel-prefix-weight and --data-parallel-load-weight cannot both be zero"
        )


_BUILT_IN_WEIGHTS = {
    Tier.NPU: "an NPU block is the unit the others are weighed against",
    Tier.HOST: "set it with --data-parallel-host-hit-weight",
    Tier.DISK: "set it with --data-parallel-disk-hit-weight",
}
"""The tiers whose weights ``routing.tier_hit_weights`` does not set, and why."""


def tier_hit_weight(
    tier: Tier, host_hit_weight: float, disk_hit_weight: float, overrides: Mapping[str, float]
) -> float:
    """The prefix-score credit of a matched block of ``tier``: 1 for the NPU, host's and
    disk's from their options, another tier's from ``overrides`` or else its registration."""
    if tier == Tier.NPU:
        return 1.0
    if tier == Tier.HOST:
        return host_hit_weight
    if tier == Tier.DISK:
        return disk_hit_weight
    return overrides.get(tier, Tier(tier).traits.hit_weight)


def _check_tier_hit_weights(weights: Mapping[str, float]) -> None:
    option = "routing.tier_hit_weights"
    for name, weight in weights.items():
        if name in _BUILT_IN_WEIGHTS:
            raise ValueError(f"{option} cannot weigh the {name} tier: {_BUILT_IN_WEIGHTS[name]}")
        if name not in tiers():
            raise ValueError(
                f"{option} names {name!r}, which is not a registered KV tier (those are: "
                f"{_names(tiers())})"
            )
        if not (0.0 <= weight <= 1.0):
            raise ValueError(f"{option}[{name!r}] must be between 0 and 1, got {weight}")


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(str(name)) for name in names) or "none"
