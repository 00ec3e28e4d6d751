import pytest

from replicas.kv.events import Tier
from router.config import RoutingConfig, TTFTCosts
from router.policies import (
    ReplicaQueues,
    RoundRobinPolicy,
    RouteDecision,
    ScoringPolicy,
    TTFTPolicy,
    make_policy,
)
from router.prefix_index import IndexMatch

BLOCK = 16
NONE = IndexMatch((0, 0, 0))


def scoring(profile: str = "balanced", **kwargs) -> ScoringPolicy:
    policy = make_policy(RoutingConfig(scoring_profile=profile, **kwargs), BLOCK)
    assert isinstance(policy, ScoringPolicy)
    return policy


def test_exact_scores_of_a_hand_built_state():
    # 64-token prompt (4 blocks); loads 100 / 0 / 300, so scale = 400 + 64 = 464.
    matches = [IndexMatch((2, 0, 0)), IndexMatch((0, 4, 0)), IndexMatch((4, 0, 0))]
    loads = [100, 0, 300]
    policy = scoring(host_hit_weight=0.5)
    assert policy.prefix_score(matches[0], 64) == 0.5
    assert policy.prefix_score(matches[1], 64) == 0.5  # 4 host blocks at weight 0.5
    assert policy.prefix_score(matches[2], 64) == 1.0
    assert policy.load_score(100, 400, 64) == pytest.approx(1 - 100 / 464)
    assert policy.load_score(300, 400, 64) == pytest.approx(1 - 300 / 464)
    decision = policy.choose([0, 1, 2], matches, loads, 64)
    # scores: 0.55*0.5 + 0.45*(364/464) = 0.628, 0.55*0.5 + 0.45*1 = 0.725, 0.55 + 0.45*(164/464)
    assert decision == RouteDecision(1, 0.5, 1.0, pytest.approx(0.725), 64, (0, 64, 0))


def test_load_score_is_one_for_all_when_nothing_is_loaded_and_prompt_is_empty():
    assert ScoringPolicy.load_score(0, 0, 0) == 1.0
    assert ScoringPolicy.load_score(0, 0, 10) == 1.0
    assert scoring().prefix_score(IndexMatch((3, 0, 0)), 0) == 0.0


def test_prefix_score_and_matched_tokens_are_capped_at_the_prompt():
    policy = scoring(host_hit_weight=0.5)
    decision = policy.choose([0], [IndexMatch((4, 0, 0))], [0], 60)
    assert decision.prefix_score == 1.0
    assert decision.num_matched_tokens == decision.num_matched_tokens_in(Tier.NPU) == 60
    mixed = policy.choose([0], [IndexMatch((3, 1, 0))], [0], 60)
    assert mixed.prefix_score == pytest.approx((3 + 0.5) * 16 / 60)
    assert (mixed.num_matched_tokens, mixed.num_matched_tokens_by_tier) == (60, (48, 12, 0))
    deep = policy.choose([0], [IndexMatch((2, 1, 3))], [0], 60)  # the prompt ends in the disk run
    assert deep.num_matched_tokens_by_tier == (32, 16, 12)
    assert deep.num_matched_tokens_in(Tier.DISK) == 12


@pytest.mark.parametrize(
    ("profile", "kwargs", "winner"),
    [
        ("balanced", {}, 0),  # 0.55 + 0.45*(64/1064) = 0.577 > 0.45
        ("locality", {}, 0),
        ("load", {}, 1),  # 0.1 + 0.9*0.06 = 0.154 < 0.9
        ("custom", {"prefix_weight": 1.0, "load_weight": 0.0}, 0),
        ("custom", {"prefix_weight": 0.0, "load_weight": 1.0}, 1),
        ("balanced", {"enable_prefix_caching": False}, 1),
    ],
)
def test_profiles_trade_a_cached_prefix_against_load(profile, kwargs, winner):
    # Replica 0 caches the whole prompt but carries 1000 tokens; replica 1 is idle and cold.
    # (The overload bound is off: at 16 it would leave replica 0 out, 1064 > 16 x 64.)
    matches = [IndexMatch((4, 0, 0)), NONE]
    policy = scoring(profile, overload_factor=0.0, **kwargs)
    assert policy.choose([0, 1], matches, [1000, 0], 64).replica_index == winner


def test_a_replica_past_the_overload_bound_is_left_out_however_much_it_caches():
    matches = [IndexMatch((4, 0, 0)), IndexMatch((1, 0, 0)), NONE]
    policy = scoring("locality")  # the bound holds whatever the weights
    # 900 + 64 <= 16 x (0 + 64) = 1024: replica 0 keeps its prefix.
    kept = policy.choose([0, 1, 2], matches, [900, 40, 0], 64)
    assert kept.replica_index == 0 and not kept.is_overload_diversion
    # 1000 + 64 > 1024: left out; of the others, the one caching a block wins.
    diverted = policy.choose([0, 1, 2], matches, [1000, 40, 0], 64)
    assert diverted.replica_index == 1 and diverted.is_overload_diversion
    # Measured against the least loaded live replica: with replica 2 dead, 40 + 64 counts.
    assert policy.choose([0, 1], matches, [1000, 40, 0], 64).replica_index == 0
    # Left out while caching no more than the chosen one: not a diversion.
    level = [IndexMatch((1, 0, 0)), IndexMatch((1, 0, 0)), NONE]
    assert not policy.choose([0, 1, 2], level, [1000, 40, 0], 64).is_overload_diversion
    # Without the bound, a million active tokens do not outweigh the prefix.
    unbounded = scoring("locality", overload_factor=0.0)
    assert unbounded.choose([0, 1, 2], matches, [10**6, 0, 0], 64).replica_index == 0


def test_the_ttft_profile_keeps_the_overload_bound():
    costs = TTFTCosts(prefill_s_per_token=0.001, max_num_batched_tokens=1000)
    matches = [IndexMatch((4, 0, 0)), NONE]
    for factor, winner in ((16.0, 1), (0.0, 0)):
        config = RoutingConfig(scoring_profile="ttft", ttft_costs=costs, overload_factor=factor)
        policy = make_policy(config, BLOCK)
        # Nothing queued: the cached replica predicts the lower TTFT, but carries 1000 tokens.
        quiet = ReplicaQueues([0, 0], [4, 0])
        assert policy.choose([0, 1], matches, [1000, 0], 64, quiet).replica_index == winner


def test_custom_weights_give_exact_scores():
    policy = scoring("custom", prefix_weight=2.0, load_weight=0.5)
    decision = policy.choose([0], [IndexMatch((1, 0, 0))], [0], 64)
    assert decision.score == 2.0 * 0.25 + 0.5 * 1.0


def test_exact_ties_go_to_the_lowest_index_live_replica():
    policy = scoring()
    assert policy.choose([0, 1, 2], [NONE] * 3, [0, 0, 0], 64).replica_index == 0
    assert policy.choose([1, 2], [NONE] * 3, [0, 0, 0], 64).replica_index == 1
    matches = [NONE, IndexMatch((1, 0, 0)), IndexMatch((3, 0, 0)), IndexMatch((3, 0, 0))]
    assert policy.choose([0, 1, 2, 3], matches, [0, 0, 10, 10], 64).replica_index == 2


def test_later_exact_ties_go_to_the_replica_sent_the_fewest_uncached_tokens():
    policy = scoring()
    idle = [0, 0, 0]
    # Cold prompts on idle replicas: each tie goes to the replica whose cache took the fewest
    # new tokens so far, so new conversations spread instead of piling onto replica 0.
    assert [policy.choose([0, 1, 2], [NONE] * 3, idle, 64).replica_index for _ in range(4)] == [
        0,
        1,
        2,
        0,
    ]
    # Churn (uncached tokens sent) is now 128 / 64 / 64. Only uncached tokens count: a full hit
    # on replica 1 adds nothing, and the next cold tie still finds 1 and 2 level (1 wins).
    assert (
        policy.choose([0, 1, 2], [NONE, IndexMatch((4, 0, 0)), NONE], idle, 64).replica_index == 1
    )
    assert policy.choose([0, 1, 2], [NONE] * 3, idle, 32).replica_index == 1  # 128 / 96 / 64
    assert policy.choose([0, 2], [NONE] * 3, idle, 64).replica_index == 2  # 128 / - / 128
    # Replica 1 (re)joins the live set level with the least-churned live replica (128): a tie
    # of all three, to the lowest index.
    assert policy.choose([0, 1, 2], [NONE] * 3, idle, 64).replica_index == 0


def test_a_host_only_match_counts_less_than_an_npu_match():
    matches = [IndexMatch((0, 4, 0)), IndexMatch((4, 0, 0))]
    assert scoring().choose([0, 1], matches, [0, 0], 64).replica_index == 1
    # At full host weight the two tie, and the tie goes to the lower index.
    tied = scoring(host_hit_weight=1.0).choose([0, 1], matches, [0, 0], 64)
    assert tied.replica_index == 0 and tied.prefix_score == 1.0
    assert scoring(host_hit_weight=0.0).prefix_score(matches[0], 64) == 0.0


def test_round_robin_cycles_over_live_replicas_in_index_order():
    policy = make_policy(RoutingConfig(policy="round-robin"), BLOCK)
    assert isinstance(policy, RoundRobinPolicy)
    matches, loads = [NONE] * 3, [0, 0, 0]
    assert [policy.choose([0, 1, 2], matches, loads, 16).replica_index for _ in range(4)] == [
        0,
        1,
        2,
        0,
    ]
    # Replica 1 is dead: skipped; then replica 2 dies right after being chosen.
    assert [policy.choose([0, 2], matches, loads, 16).replica_index for _ in range(3)] == [2, 0, 2]
    assert policy.choose([0, 1], matches, loads, 16).replica_index == 0
    assert policy.choose([0, 1], matches, loads, 16).replica_index == 1


def test_round_robin_does_not_score_but_reports_the_chosen_replicas_scores():
    policy = make_policy(RoutingConfig(policy="round-robin"), BLOCK)
    decision = policy.choose([0, 1], [IndexMatch((1, 1, 0)), NONE], [32, 0], 64)
    assert decision == RouteDecision(0, (1 + 0.9) * 16 / 64, 1 - 32 / 96, 0.0, 32, (16, 16, 0))


def test_load_counts_as_a_share_of_the_cluster_load():
    # A quarter of a 128-token prompt cached on replica 0, which carries the most load.
    matches = [IndexMatch((2, 0, 0)), NONE, NONE, NONE]
    policy = scoring()
    busy = policy.choose([0, 1, 2, 3], matches, [1000, 500, 500, 500], 128)
    # 0.55 * 0.25 + 0.45 * (1 - 1000/2628) = 0.416 > 0.45 * (1 - 500/2628) = 0.364
    assert busy.replica_index == 0 and busy.score == pytest.approx(0.4162, abs=1e-4)
    lopsided = policy.choose([0, 1, 2, 3], matches, [1000, 0, 0, 0], 128)
    # 0.55 * 0.25 + 0.45 * (1 - 1000/1128) = 0.189 < 0.45 for an idle replica
    assert lopsided.replica_index == 1 and lopsided.score == pytest.approx(0.45)


def test_ttft_profile_predicts_queue_plus_reload_plus_suffix_by_hand():
    costs = TTFTCosts(
        step_s=0.01,
        prefill_s_per_token=0.001,
        prefill_s_per_token_context=1e-6,
        decode_s_per_seq=0.002,
        decode_s_per_context_token=1e-5,
        reload_s_per_block=0.003,
        max_num_batched_tokens=100,
    )
    policy = make_policy(RoutingConfig(scoring_profile="ttft", ttft_costs=costs), 16)
    assert isinstance(policy, TTFTPolicy)
    # Replica 0: 4 NPU + 2 host blocks cached (96 tokens), 150 tokens queued, 3 requests, 400
    # active tokens. A 160-token prompt leaves 64 to compute: work 214, 3 steps.
    expected = (
        0.001 * 214
        + 1e-6 * 64 * (96 + 32)
        + 3 * (0.01 + 0.002 * 3 + 1e-5 * (400 - 150))
        + 0.003 * 2
    )
    assert policy.predicted_ttft_s(IndexMatch((4, 2, 0)), 160, 150, 3, 400) == pytest.approx(
        expected
    )
    # Replica 1: nothing cached, idle: 160 tokens, 2 steps of the fixed cost.
    idle = 0.001 * 160 + 1e-6 * 160 * 80 + 2 * 0.01
    assert policy.predicted_ttft_s(NONE, 160, 0, 0, 0) == pytest.approx(idle)
    queues = ReplicaQueues([150, 0], [3, 0])
    decision = policy.choose([0, 1], [IndexMatch((4, 2, 0)), NONE], [400, 0], 160, queues)
    assert decision.replica_index == (0 if expected < idle else 1)
    # Without the queue, the cached replica wins.
    quiet = ReplicaQueues([0, 0], [0, 0])
    assert (
        policy.choose([0, 1], [IndexMatch((4, 2, 0)), NONE], [0, 0], 160, quiet).replica_index == 0
    )


def test_ttft_forfeit_weight_prices_the_reuse_a_placement_gives_up():
    costs = TTFTCosts(prefill_s_per_token=0.001, max_num_batched_tokens=1000, forfeit_weight=2)
    policy = make_policy(RoutingConfig(scoring_profile="ttft", ttft_costs=costs), 16)
    matches = [IndexMatch((6, 0, 0)), NONE]  # replica 0 caches 96 of the 160 tokens
    queues = ReplicaQueues([150, 0], [1, 0])
    # Replica 0: (150 + 64) x 0.001 = 0.214. Replica 1: 160 x 0.001 + 2 x 96 x 0.001 = 0.352.
    assert policy.cost_s(1, matches, [0, 0], 160, queues, best_blocks=6) == pytest.approx(0.352)
    assert policy.choose([0, 1], matches, [150, 0], 160, queues).replica_index == 0
    plain = make_policy(
        RoutingConfig(
            scoring_profile="ttft", ttft_costs=costs.model_copy(update={"forfeit_weight": 0})
        ),
        16,
    )
    assert plain.choose([0, 1], matches, [150, 0], 160, queues).replica_index == 1
