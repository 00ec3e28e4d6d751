"""What a routing policy decides (``RouteDecision``) and the queues it may weigh."""

from collections.abc import Sequence
from typing import NamedTuple

from replicas.kv.events import Tier, tier_count


class ReplicaQueues(NamedTuple):
    """What each replica has queued and running, as the router charged it."""

    queued_tokens: Sequence[int]  # uncached prompt tokens not past prefill yet
    num_requests: Sequence[int]  # requests routed there and not released


class RouteDecision(NamedTuple):
    """Where one request goes, and why (scores of the chosen replica)."""

    replica_index: int
    prefix_score: float
    load_score: float
    score: float
    num_matched_tokens: int
    """Prompt tokens cached on the chosen replica in any tier (unweighted), at most the prompt."""
    num_matched_tokens_by_tier: tuple[int, ...]
    """``num_matched_tokens`` per tier (``replicas.kv.events.tiers()`` order): the match's blocks
    in tier order, cut at the prompt's end."""
    is_key_affinity: bool = False
    """Whether the chosen replica is the request's ``prompt_cache_key`` replica, credited as
    caching the whole prompt (it was not overloaded)."""
    peer_source: int | None = None
    """Another replica holding a longer prefix in its NPU and host tiers, which the chosen one
    may pull it from (``Router.route``); None when none holds enough more."""
    num_peer_tokens: int = 0
    """The leading prompt tokens ``peer_source`` holds (whole blocks)."""
    is_overload_diversion: bool = False
    """Whether a replica caching more of the prompt was left out for carrying more than
    ``routing.overload_factor`` times the least loaded replica's load."""

    def num_matched_tokens_in(self, tier: Tier) -> int:
        return tier_count(self.num_matched_tokens_by_tier, tier)
