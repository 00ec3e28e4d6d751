"""The routing agent of a simulated cluster's policy: Strata's router (with the ``ttft``
profile's costs from the cost model) or a peer's (``peers.py``)."""

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from benchmarks.sim.agents import ClusterView, RoutingAgent, StrataAgent
from benchmarks.sim.cost_model import CostModel
from benchmarks.sim.peers import PEERS
from router.config import RoutingConfig, TTFTCosts

if TYPE_CHECKING:
    from benchmarks.sim.simulator import SimConfig

STRATA = "strata"


def ttft_costs(config: "SimConfig", cost_model: CostModel) -> TTFTCosts:
    """The ``ttft`` profile's costs from the cost model, per simulated token (the router counts
    simulated tokens; the cost model's coefficients are per trace token)."""
    p, s = cost_model.profile, config.token_scale
    return TTFTCosts(
        step_s=p.step_fixed_s,
        prefill_s_per_token=p.prefill_per_token_s * s,
        prefill_s_per_token_context=p.prefill_per_token_context_s * s * s,
        decode_s_per_seq=p.decode_per_seq_s,
        decode_s_per_context_token=p.decode_per_context_token_s * s,
        reload_s_per_block=cost_model.load_s(1),
        max_num_batched_tokens=config.max_num_batched_tokens,
        slack=config.ttft_slack,
        forfeit_weight=config.ttft_forfeit_weight,
    )


def make_agent(
    config: "SimConfig",
    view: ClusterView,
    cost_model: CostModel | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RoutingAgent:
    """The routing agent of ``config.policy``; ``clock``: Strata's router's (simulated time)."""
    if config.policy == STRATA:
        costs = None
        if config.scoring_profile == "ttft":
            assert cost_model is not None, "the ttft profile prices with the cost model"
            costs = ttft_costs(config, cost_model)
        routing = RoutingConfig(
            scoring_profile=config.scoring_profile,
            ttft_costs=costs,
            key_overload_factor=config.key_overload_factor,
            overload_factor=config.overload_factor,
            peer_pull_min_blocks=config.peer_pull_min_blocks,
        )
        return StrataAgent(
            view, config.block_size, config.token_scale, routing, config.sliding_window, clock
        )
    if config.policy not in PEERS:
        raise ValueError(f"unknown policy {config.policy!r}; one of {[STRATA, *PEERS]}")
    return PEERS[config.policy](view, config.block_size, config.token_scale, config.seed)
