"""Start-up step costs (``replicas.calibration``): the least-squares fit on constructed samples,
the measurement on a real engine, and the router priced with them."""

import pytest

from replicas.calibration import fit_step_costs, measure_step_costs
from replicas.config import EngineConfig, KVOffloadConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.events import Tier
from replicas.step_costs import StepCosts, median_costs
from router.actor import measured_ttft_costs
from router.config import RoutingConfig, TTFTCosts
from router.policies import TTFTPolicy, make_policy
from router.router import Router

TRUE = {
    "step_s": 0.004,
    "prefill_s_per_token": 2e-4,
    "prefill_s_per_token_context": 3e-8,
    "decode_s_per_seq": 5e-4,
    "decode_s_per_context_token": 1e-6,
}


def _prefill(n: int, context: int, c: dict[str, float]) -> tuple[int, int, float]:
    seconds = (
        c["step_s"]
        + c["prefill_s_per_token"] * n
        + c["prefill_s_per_token_context"] * n * (context + n / 2)
    )
    return n, context, seconds


def _decode(seqs: int, context: int, c: dict[str, float]) -> tuple[int, int, float]:
    seconds = c["step_s"] + c["decode_s_per_seq"] * seqs + c["decode_s_per_context_token"] * context
    return seqs, context, seconds


def test_fit_recovers_the_constants_of_exact_samples():
    prefill = [_prefill(n, ctx, TRUE) for n, ctx in ((64, 0), (256, 0), (512, 0), (64, 512))]
    decode = [_decode(d, c, TRUE) for d, c in ((1, 64), (4, 1024), (8, 512))]
    fitted, error = fit_step_costs(prefill, decode)
    assert fitted == pytest.approx(TRUE, rel=1e-6)
    assert error == pytest.approx(0, abs=1e-9)


def test_fit_drops_a_negative_coefficient_and_refits_the_rest():
    # Decode steps that get faster with more sequences would fit a negative per-sequence cost.
    constants = dict(TRUE, decode_s_per_seq=-1e-4)
    prefill = [_prefill(n, 0, constants) for n in (64, 256, 512)]
    decode = [_decode(d, c, constants) for d, c in ((1, 64), (4, 1024), (8, 512))]
    fitted, _ = fit_step_costs(prefill, decode)
    assert fitted["decode_s_per_seq"] == 0
    assert all(v >= 0 for v in fitted.values())


def test_fit_keeps_the_per_token_prefill_cost_when_noise_would_drop_it():
    # Contended timings: the longer prefill measured faster than the shorter one.
    # Dropping the most negative coefficient each time would drop the per-token cost here.
    prefill = [(32, 0, 0.050), (128, 0, 0.045), (128, 256, 0.047)]
    decode = [(1, 64, 0.050), (4, 256, 0.051)]
    fitted, _ = fit_step_costs(prefill, decode)
    assert fitted["prefill_s_per_token"] > 0
    assert fitted["step_s"] == 0  # the fixed cost gave way instead
    assert all(v >= 0 for v in fitted.values())
    # Without the fixed cost the context term absorbs the prefill time: it gives way too, and
    # the per-token cost is fitted through the origin on the cold samples.
    prefill = [(32, 0, 0.010), (128, 0, 0.005), (32, 256, 0.060)]
    fitted, _ = fit_step_costs(prefill, decode)
    assert fitted["step_s"] == fitted["prefill_s_per_token_context"] == 0
    expected = (32 * 0.010 + 128 * 0.005 + 32 * 0.060) / (32**2 + 128**2 + 32**2)
    assert fitted["prefill_s_per_token"] == pytest.approx(expected)


def test_median_costs_takes_each_fields_median():
    def costs(x: float, tokens: int) -> StepCosts:
        return StepCosts(x, 2 * x, 0.0, x, x, x, 0.0, tokens, 0.01, 1.0)

    median = median_costs([costs(1.0, 2048), costs(3.0, 1024), costs(2.0, 2048)])
    assert median.step_s == 2.0 and median.prefill_s_per_token == 4.0
    assert median.max_num_batched_tokens == 1024  # the smallest step budget
    ttft = measured_ttft_costs([costs(1.0, 2048), costs(3.0, 2048)])
    assert ttft.prefill_s_per_token == 4.0 and ttft.max_num_batched_tokens == 2048
    assert ttft.forfeit_weight == 0 and ttft.slack == 0


def test_measure_on_a_real_engine_leaves_it_idle_and_empty():
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=1.0)
    engine = Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=512,
            num_threads=1,
            scheduler_config=SchedulerConfig(kv_offload_config=offload),
        )
    )
    costs = measure_step_costs(engine)
    assert costs.prefill_s_per_token > 0 and costs.reload_s_per_block > 0
    assert costs.disk_reload_s_per_block == 0  # no disk tier
    assert costs.max_num_batched_tokens == engine.config.scheduler_config.max_num_batched_tokens
    assert all(v >= 0 for v in costs.ttft_costs().values())
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    stats = engine.stats()
    assert stats.cache.queries == stats.cache.hits == 0  # the samples are not served traffic
    assert stats.steps.num_steps == 0
    for usage in engine.kv_cache.views.usage().values():
        assert usage.of(Tier.NPU).num_used == usage.of(Tier.NPU).num_cached == 0
        assert usage.of(Tier.HOST).num_used == usage.of(Tier.HOST).num_cached == 0
    # A prompt the samples never saw is computed from scratch afterwards.
    request = engine.add_request("after", list(range(1, 100)))
    while not request.is_finished:
        engine.step()
    assert request.num_cached_tokens == 0


def test_router_without_a_cost_profile_routes_once_given_one():
    config = RoutingConfig(scoring_profile="ttft")
    assert config.needs_ttft_costs
    assert not RoutingConfig(scoring_profile="ttft", enable_prefix_caching=False).needs_ttft_costs
    with pytest.raises(ValueError, match=r"routing\.ttft_costs"):
        make_policy(config, 16)
    router = Router(2, 16, config)
    with pytest.raises(RuntimeError, match="no cost profile"):
        router.route("r0", 32, [])
    costs = TTFTCosts(prefill_s_per_token=0.001, max_num_batched_tokens=256)
    router.set_ttft_costs(costs)
    assert router.config.ttft_costs == costs
    assert isinstance(router._policy, TTFTPolicy)
    assert router.route("r0", 32, []).replica_index == 0
    with pytest.raises(ValueError, match="ttft scoring profile"):
        Router(2, 16, RoutingConfig()).set_ttft_costs(costs)
