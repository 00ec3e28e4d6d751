"""Routing policies: given what each live replica caches and carries, pick one.

A policy only reads: the router computes the prefix matches and owns the loads, and charges the
chosen replica afterwards. Policies are classes chosen by ``RoutingConfig.policy``
(``make_policy``), so no method checks which policy is on.
"""

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

from replicas.kv.events import Tier, tiers
from router.config import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_KEY_OVERLOAD_FACTOR,
    DEFAULT_OVERLOAD_FACTOR,
    DEFAULT_SCORING_PROFILE,
    SCORING_PROFILES,
    RoutingConfig,
    TTFTCosts,
    tier_hit_weight,
)
from router.decision import ReplicaQueues, RouteDecision
from router.prefix_index import IndexMatch


class RoutingPolicy(ABC):
    """Picks a replica among the live ones; shared scoring helpers live here.

    ``prefix_score`` of a replica whose cached prefix is ``blocks[t]`` blocks in each tier ``t``
    (``npu`` NPU blocks and ``host`` host-only blocks in any interleaving, then the blocks
    only a backing tier such as the node's disk holds), for a prompt of ``P`` tokens::

        prefix_score = min(1, (npu + sum(weight[t] * blocks[t] for t past the NPU))
                              * block_size / P)                              (0 when P = 0)

    with ``weight[t]`` the tier's ``tier_weight``: host_hit_weight for host, disk_hit_weight
    for disk, another tier's ``tier_hit_weights`` entry or else its registered hit weight.

    ``load_score`` of live replica i, with ``load`` the active context tokens per replica::

        scale      = sum(load[j] for live j) + P
        load_score = 1 - load[i] / scale                                      (1 when scale = 0)

    i.e. one minus the replica's share of the cluster's active tokens once this request is
    added: the least loaded replica scores highest, the score lies in (0, 1] for P > 0, a
    replica carrying most of the cluster's work scores near 0, and load differences count in
    proportion to the share of the work they are. (Measured against the heaviest replica
    instead, every difference between busy replicas looked large: on a loaded cluster the load
    term then moved sessions away from their cached prefix. Figures: ``benchmarks/README.md``,
    section "Strata's router: pending prompts, host hits at 0.9, load as a share", item 3.)
    """

    name: ClassVar[str]
    disk_hit_weight: float = DEFAULT_DISK_HIT_WEIGHT  # make_policy sets the config's
    tier_hit_weights: Mapping[str, float] = MappingProxyType({})
    """Weights by tier name past host and disk (make_policy sets the config's): a read-only
    mapping, replaced (not changed in place) to change a weight."""
    key_overload_factor: float = DEFAULT_KEY_OVERLOAD_FACTOR  # make_policy sets the config's
    overload_factor: float = DEFAULT_OVERLOAD_FACTOR  # make_policy sets the config's
    _weights_key: tuple = ()
    _weights: tuple[float, ...] = ()

    def __init__(self, block_size: int, host_hit_weight: float) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.host_hit_weight = host_hit_weight

    @classmethod
    @abstractmethod
    def from_config(cls, config: RoutingConfig, block_size: int) -> "RoutingPolicy": ...

    @abstractmethod
    def choose(
        self,
        live: Sequence[int],
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: "ReplicaQueues | None" = None,
        key_replica: int | None = None,
    ) -> RouteDecision:
        """Pick one of ``live`` (non-empty, ascending replica indices). ``matches``,
        ``load_tokens`` and ``queues`` are indexed by replica index; ``key_replica`` is the
        replica that served the request's ``prompt_cache_key`` last (a live one, or None).
        Does not charge anything."""

    def is_overloaded(
        self, replica: int, live: Sequence[int], load_tokens: Sequence[int], num_prompt_tokens: int
    ) -> bool:
        """The load rule that bounds ``prompt_cache_key`` affinity: whether ``replica``'s
        active tokens, this prompt added, exceed ``key_overload_factor`` times the least
        loaded live replica's, this prompt added::

            load[r] + P > key_overload_factor * (min(load[j] for live j) + P)

        The prompt added on both sides makes its size the floor: on an idle cluster a key
        keeps ``key_overload_factor`` of its concurrent prompts together."""
        least = min(load_tokens[r] for r in live)
        num = num_prompt_tokens
        return load_tokens[replica] + num > self.key_overload_factor * (least + num)

    def tier_weight(self, tier: Tier) -> float:
        """What a matched block of ``tier`` counts for, against 1 for an NPU block."""
        return tier_hit_weight(
            tier, self.host_hit_weight, self.disk_hit_weight, self.tier_hit_weights
        )

    def tier_weights(self) -> tuple[float, ...]:
        """Every registered tier's ``tier_weight``, in ``tiers()`` order; rebuilt when a tier
        is registered or a weight changes (scoring reads it for every replica)."""
        key = (len(Tier), self.host_hit_weight, self.disk_hit_weight, self.tier_hit_weights)
        if key != self._weights_key:
            self._weights_key = key
            self._weights = tuple(self.tier_weight(tier) for tier in tiers())
        return self._weights

    def prefix_score(
        self, match: IndexMatch, num_prompt_tokens: int, weights: Sequence[float] | None = None
    ) -> float:
        """``weights``: ``tier_weights()``, when the caller scores many matches at once."""
        if num_prompt_tokens <= 0:
            return 0.0
        weighted_blocks = 0.0
        for weight, num_blocks in zip(weights or self.tier_weights(), match.num_blocks_by_tier):
            weighted_blocks += weight * num_blocks
        return min(1.0, weighted_blocks * self.block_size / num_prompt_tokens)

    @staticmethod
    def load_score(load: int, total_live_load: int, num_prompt_tokens: int) -> float:
        scale = total_live_load + num_prompt_tokens
        return 1.0 - load / scale if scale > 0 else 1.0

    def _decision(
        self,
        replica: int,
        match: IndexMatch,
        prefix_score: float,
        load_score: float,
        score: float,
        num_prompt_tokens: int,
        is_key_affinity: bool = False,
    ) -> RouteDecision:
        num_by_tier = []
        num_matched = num_blocks = 0
        for num_tier_blocks in match.num_blocks_by_tier:
            num_blocks += num_tier_blocks
            end = min(num_blocks * self.block_size, num_prompt_tokens)
            num_by_tier.append(end - num_matched)
            num_matched = end
        return RouteDecision(
            replica,
            prefix_score,
            load_score,
            score,
            num_matched,
            tuple(num_by_tier),
            is_key_affinity,
        )


class ScoringPolicy(RoutingPolicy):
    """Highest ``prefix_weight * prefix_score + load_weight * load_score`` wins.

    An exact tie (in practice: idle replicas, and a prompt cached on none of them) goes to the
    tied replica this policy has sent the fewest *uncached* prompt tokens so far, i.e. the one
    whose cache has taken the fewest new blocks (the least eviction pressure); among those, to
    the lowest index. A fresh policy therefore picks the lowest-index tied replica, and a
    replica that (re)joins the live set starts level with the least-churned live replica.

    Why not always the lowest index: when several replicas are idle, every new conversation
    would land on replica 0, whose cache then churns fastest and whose later turns pile up
    there, lowering the hit rate and unbalancing the load (trace simulator, ``benchmarks/sim``;
    figures: ``benchmarks/README.md``, section "Strata's scoring policy: a changed tie rule").
    Like the round-robin cursor, the churn count is the policy's own state: ``choose`` updates
    it for the replica it returns.

    ``prompt_cache_key``: the replica that served the request's key last scores
    ``prefix_score = 1`` (as if it cached the whole prompt) unless ``is_overloaded`` says it
    carries too much; then every replica is scored as without a key. (The ``ttft`` profile
    prices only what the index holds, so a key does not move its prediction.)
    """

    name = "scoring"

    def __init__(
        self, block_size: int, host_hit_weight: float, prefix_weight: float, load_weight: float
    ) -> None:
        super().__init__(block_size, host_hit_weight)
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self._uncached_tokens: dict[int, int] = {}  # replica -> uncached prompt tokens sent
        self._live: frozenset[int] = frozenset()

    @classmethod
    def from_config(cls, config: RoutingConfig, block_size: int) -> "ScoringPolicy":
        prefix_weight, load_weight = config.weights
        return cls(block_size, config.host_hit_weight, prefix_weight, load_weight)

    def choose(
        self,
        live: Sequence[int],
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: ReplicaQueues | None = None,
        key_replica: int | None = None,
    ) -> RouteDecision:
        self._level_joined(live)
        total_live_load = sum(load_tokens[replica] for replica in live)
        if key_replica is not None and (
            key_replica not in live
            or self.is_overloaded(key_replica, live, load_tokens, num_prompt_tokens)
        ):
            key_replica = None  # the load rule wins: scored as if the request had no key
        best_score = -math.inf
        tied: list[tuple[int, float, float]] = []  # (replica, prefix_score, load_score)
        weights = self.tier_weights()
        candidates = self.candidates(live, matches, load_tokens, num_prompt_tokens, queues)
        for replica in candidates:
            prefix_score = self.prefix_score(matches[replica], num_prompt_tokens, weights)
            if replica == key_replica:
                prefix_score = 1.0  # the key's earlier requests: counted as the whole prompt
            load_score = self.load_score(load_tokens[replica], total_live_load, num_prompt_tokens)
            score = self.score(
                replica, prefix_score, load_score, matches, load_tokens, num_prompt_tokens, queues
            )
            if score > best_score:
                best_score, tied = score, [(replica, prefix_score, load_score)]
            elif score == best_score:
                tied.append((replica, prefix_score, load_score))
        assert tied, "choose needs at least one live replica"
        churn = self._uncached_tokens
        replica, prefix_score, load_score = min(tied, key=lambda t: (churn[t[0]], t[0]))
        decision = self._decision(
            replica,
            matches[replica],
            prefix_score,
            load_score,
            best_score,
            num_prompt_tokens,
            replica == key_replica,
        )
        churn[replica] += num_prompt_tokens - decision.num_matched_tokens
        if len(candidates) < len(live):
            held = matches[replica].num_blocks
            if any(matches[r].num_blocks > held for r in set(live).difference(candidates)):
                return decision._replace(is_overload_diversion=True)
        return decision

    def candidates(
        self,
        live: Sequence[int],
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: ReplicaQueues | None,
    ) -> Sequence[int]:
        """The live replicas this policy scores: not those whose ``load + P`` exceeds
        ``overload_factor x (least live load + P)`` (0: none left out)."""
        factor = self.overload_factor
        if not factor or len(live) < 2:
            return live
        bound = factor * (min(load_tokens[r] for r in live) + num_prompt_tokens)
        return [r for r in live if load_tokens[r] + num_prompt_tokens <= bound]

    def score(
        self,
        replica: int,
        prefix_score: float,
        load_score: float,
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: ReplicaQueues | None,
    ) -> float:
        """Higher is better: the weighted sum of the two scores."""
        return self.prefix_weight * prefix_score + self.load_weight * load_score

    def _level_joined(self, live: Sequence[int]) -> None:
        """Start replicas new to the live set at the least churn among the others."""
        if len(live) == len(self._live) and self._live.issuperset(live):
            return
        current = frozenset(live)
        churn = self._uncached_tokens
        staying = [churn[r] for r in current & self._live]
        for replica in current - self._live:
            churn[replica] = min(staying, default=0)
        self._live = current


class RoundRobinPolicy(RoutingPolicy):
    """Cycles over the live replicas in index order, skipping dead ones: the next live replica
    after the one chosen last (wrapping). Does not score: ``score`` is 0.0, while
    ``prefix_score`` and ``load_score`` are the chosen replica's, for metrics."""

    name = "round-robin"

    def __init__(self, block_size: int, host_hit_weight: float) -> None:
        super().__init__(block_size, host_hit_weight)
        self._next_replica = 0

    @classmethod
    def from_config(cls, config: RoutingConfig, block_size: int) -> "RoundRobinPolicy":
        return cls(block_size, config.host_hit_weight)

    def choose(
        self,
        live: Sequence[int],
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: ReplicaQueues | None = None,
        key_replica: int | None = None,
    ) -> RouteDecision:
        replica = next((r for r in live if r >= self._next_replica), live[0])
        self._next_replica = replica + 1
        total_live_load = sum(load_tokens[r] for r in live)
        return self._decision(
            replica,
            matches[replica],
            self.prefix_score(matches[replica], num_prompt_tokens),
            self.load_score(load_tokens[replica], total_live_load, num_prompt_tokens),
            0.0,
            num_prompt_tokens,
        )


class TTFTPolicy(ScoringPolicy):
    """The lowest predicted time to first token wins (``scoring_profile="ttft"``); ties, and
    ``prefix_score`` / ``load_score`` in the decision, as ``ScoringPolicy``. For a prompt of
    ``P`` tokens whose cached prefix on replica i is ``npu + host`` blocks (``m`` tokens), with
    ``q`` uncached prompt tokens queued there, ``n`` requests and ``L`` active tokens::

        s       = P - m                            this prompt's uncached suffix
        work    = q + s                            tokens to prefill up to this prompt's last
        prefill = prefill_s_per_token x work + prefill_s_per_token_context x s x (m + s / 2)
        steps   = ceil(work / max_num_batched_tokens)
        decode  = steps x (step_s + decode_s_per_seq x n + decode_s_per_context_token x (L - q))
        ttft    = prefill + decode + sum(reload[t] x blocks[t] for every tier t)

    i.e. the queue ahead is served first, each step also advances the replica's running
    sequences, and the blocks past the NPU are reloaded: ``reload[t]`` is the costs'
    ``reload_s_per_block_of(t)`` (host: reload_s_per_block, disk: disk_reload_s_per_block, another
    backing tier: its tier_reload_s_per_block entry, else disk's). ``score`` is ``-ttft``."""

    name = "ttft"

    def __init__(self, block_size: int, host_hit_weight: float, costs: TTFTCosts) -> None:
        super().__init__(block_size, host_hit_weight, *SCORING_PROFILES[DEFAULT_SCORING_PROFILE])
        self.costs = costs
        self._best_blocks = 0
        self._reload_key: tuple = ()
        self._reload: tuple[float, ...] = ()

    @classmethod
    def from_config(cls, config: RoutingConfig, block_size: int) -> "TTFTPolicy":
        if config.ttft_costs is None:
            raise ValueError(
                "the ttft scoring profile has no cost profile: set routing.ttft_costs or let "
                "the deployment measure one at start-up"
            )
        return cls(block_size, config.host_hit_weight, config.ttft_costs)

    def predicted_ttft_s(
        self,
        match: IndexMatch,
        num_prompt_tokens: int,
        queued_tokens: int,
        num_requests: int,
        load_tokens: int,
    ) -> float:
        c = self.costs
        cached = min(match.num_blocks * self.block_size, max(0, num_prompt_tokens - 1))
        suffix = num_prompt_tokens - cached
        work = queued_tokens + suffix
        prefill = c.prefill_s_per_token * work
        prefill += c.prefill_s_per_token_context * suffix * (cached + suffix / 2)
        steps = -(-work // c.max_num_batched_tokens)
        running = max(0, load_tokens - queued_tokens)
        decode = steps * (
            c.step_s + c.decode_s_per_seq * num_requests + c.decode_s_per_context_token * running
        )
        ttft = prefill + decode
        for reload_s, num_blocks in zip(self.reload_costs(), match.num_blocks_by_tier):
            ttft += reload_s * num_blocks
        return ttft

    def reload_costs(self) -> tuple[float, ...]:
        """Every registered tier's reload time per block, in ``tiers()`` order (the NPU's 0);
        rebuilt when a tier is registered or the costs change."""
        c = self.costs
        key = (
            len(Tier),
            c.reload_s_per_block,
            c.disk_reload_s_per_block,
            c.tier_reload_s_per_block,
        )
        if key != self._reload_key:
            self._reload_key = (*key[:3], dict(c.tier_reload_s_per_block))
            self._reload = tuple(c.reload_s_per_block_of(tier) for tier in tiers())
        return self._reload

    def choose(
        self,
        live: Sequence[int],
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: ReplicaQueues | None = None,
        key_replica: int | None = None,
    ) -> RouteDecision:
        # The prediction prices what the index holds: a key does not move it.
        return super().choose(live, matches, load_tokens, num_prompt_tokens, queues)

    def candidates(
        self,
        live: Sequence[int],
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: ReplicaQueues | None,
    ) -> Sequence[int]:
        """``ScoringPolicy``'s, and with ``slack``: of those within ``1 + slack`` of the
        lowest cost, the ones caching the most."""
        # The forfeit term's reference: the best-cached live replica, found once per request.
        self._best_blocks = max(matches[r].num_blocks for r in live)
        live = super().candidates(live, matches, load_tokens, num_prompt_tokens, queues)
        if self.costs.slack:
            cost = {
                r: self.cost_s(r, matches, load_tokens, num_prompt_tokens, queues) for r in live
            }
            bound = min(cost.values()) * (1 + self.costs.slack)
            close = [r for r in live if cost[r] <= bound]
            longest = max(matches[r].num_blocks for r in close)
            live = [r for r in close if matches[r].num_blocks == longest]
        return live

    def cost_s(
        self,
        replica: int,
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: ReplicaQueues | None,
        best_blocks: int | None = None,
    ) -> float:
        """The predicted TTFT on ``replica`` plus the forfeit term, against the best-cached
        replica (``best_blocks``; by default the one ``choose`` found)."""
        match = matches[replica]
        queued = queues.queued_tokens[replica] if queues is not None else 0
        count = queues.num_requests[replica] if queues is not None else 0
        cost = self.predicted_ttft_s(match, num_prompt_tokens, queued, count, load_tokens[replica])
        weight = self.costs.forfeit_weight
        if weight:
            best = self._best_blocks if best_blocks is None else best_blocks
            lacking = min(best * self.block_size, num_prompt_tokens) - min(
                match.num_blocks * self.block_size, num_prompt_tokens
            )
            cost += weight * self.costs.prefill_s_per_token * max(0, lacking)
        return cost

    def score(
        self,
        replica: int,
        prefix_score: float,
        load_score: float,
        matches: Sequence[IndexMatch],
        load_tokens: Sequence[int],
        num_prompt_tokens: int,
        queues: ReplicaQueues | None,
    ) -> float:
        return -self.cost_s(replica, matches, load_tokens, num_prompt_tokens, queues)


POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy for policy in (ScoringPolicy, RoundRobinPolicy)
}
"""Policy classes by ``--data-parallel-routing-policy`` name."""


def make_policy(config: RoutingConfig, block_size: int) -> RoutingPolicy:
    """The policy ``config.policy`` names, configured from ``config`` (``scoring`` with the
    ``ttft`` profile is ``TTFTPolicy``)."""
    if (
        config.policy == ScoringPolicy.name
        and config.scoring_profile == TTFTPolicy.name
        and config.enable_prefix_caching
    ):
        policy: RoutingPolicy = TTFTPolicy.from_config(config, block_size)
    else:
        policy = POLICIES[config.policy].from_config(config, block_size)
    policy.disk_hit_weight = config.disk_hit_weight
    policy.tier_hit_weights = MappingProxyType(dict(config.tier_hit_weights))
    policy.key_overload_factor = config.key_overload_factor
    policy.overload_factor = config.overload_factor
    return policy
