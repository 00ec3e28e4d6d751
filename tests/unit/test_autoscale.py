"""The autoscaling policy (``cluster.autoscale``) on a fake clock and fake stats."""

import asyncio

import pytest
from pydantic import ValidationError

from cluster.autoscale import DOWN, HOLD, UP, AutoscalePolicy, Autoscaler, QueueEstimator
from cluster.autoscale import ReplicaLoad as Load
from cluster.backend import ClusterStats, ReplicaStats
from cluster.config import ClusterConfig, ScalingConfig
from cluster.metrics import StrataMetrics
from replicas.engine.engine import EngineStats, StepTimes
from replicas.kv.records import CacheStats
from router.stats import ReplicaRoutingStats, RouterStats

CONFIG = ScalingConfig(
    min_replicas=1,
    max_replicas=4,
    target_queue_s=1.0,
    downscale_queue_fraction=0.25,
    look_back_period_s=10.0,
    upscale_delay_s=5.0,
    downscale_delay_s=20.0,
    cooldown_s=30.0,
)


def loads(n: int, queue_s: float, requests: int = 1) -> list[Load]:
    return [Load(r, 0, requests, queue_s) for r in range(n)]


def run(policy: AutoscalePolicy, n: int, queue_s: float, start: float, end: float, **kw) -> list:
    """Decisions once a second over [start, end)."""
    return [
        policy.decide(n, loads(n, queue_s, **kw), float(t)) for t in range(int(start), int(end))
    ]


def test_scales_out_once_queueing_stayed_above_target_for_the_delay():
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)
    decisions = run(policy, 2, 1.5, 0, 6)
    assert [d.direction for d in decisions] == [HOLD] * 5 + [UP]
    # ceil(2 * 1.5 / 1.0) = 3 replicas wanted: one more
    assert decisions[-1].num_replicas == 3
    assert "1.50s > target 1s" in decisions[-1].reason


def test_a_deep_queue_scales_out_by_several_and_stops_at_max_replicas():
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)
    assert run(policy, 1, 2.5, 0, 6)[-1].num_replicas == 3  # ceil(1 * 2.5) = 3
    policy = AutoscalePolicy(CONFIG.model_copy(update={"upscaling_factor": 0.5}), 8)
    assert run(policy, 1, 2.5, 0, 6)[-1].num_replicas == 2  # the step of 2 halved
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)
    assert run(policy, 2, 9.0, 0, 6)[-1].num_replicas == 4
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)
    at_max = run(policy, 4, 9.0, 0, 20)
    assert {d.direction for d in at_max} == {HOLD}
    assert "at max_replicas" in at_max[-1].reason


def test_a_dip_below_target_restarts_the_upscale_delay():
    policy = AutoscalePolicy(CONFIG.model_copy(update={"look_back_period_s": 1.0}), 8)
    run(policy, 2, 1.5, 0, 4)
    policy.decide(2, loads(2, 0.5), 4.0)
    assert [d.direction for d in run(policy, 2, 1.5, 5, 11)] == [HOLD] * 5 + [UP]


def test_the_look_back_averages_a_spike_away():
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)  # 10 s look-back
    run(policy, 2, 0.5, 0, 9)
    # One tick at 4 s: the mean of nine ticks at 0.5 s and this one is 0.85 s, under target.
    decision = policy.decide(2, loads(2, 4.0), 9.0)
    assert decision.direction == HOLD
    assert "0.85s" in decision.reason


def test_the_hysteresis_band_changes_nothing():
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)
    # 0.5 s on 2 replicas is 1 s on one: above the band (0.25 s), under the target.
    assert {d.direction for d in run(policy, 2, 0.5, 0, 200)} == {HOLD}


def test_scales_in_one_replica_after_the_idle_delay():
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)
    decisions = run(policy, 3, 0.05, 0, 21)
    assert [d.direction for d in decisions] == [HOLD] * 20 + [DOWN]
    # 0.05 s on 3 is 0.075 s on 2 and 0.15 s on 1, under 0.25 s: the fewest fitting is 1,
    # and without downscaling_factor the step is all of it
    assert decisions[-1].num_replicas == 1
    halved = AutoscalePolicy(CONFIG.model_copy(update={"downscaling_factor": 0.5}), 8)
    assert run(halved, 3, 0.05, 0, 21)[-1].num_replicas == 2


def test_requests_that_do_not_fit_on_fewer_replicas_keep_them():
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)
    # 3 replicas running 6 requests each: 18 requests need 3 replicas of 8 sequences
    assert {d.direction for d in run(policy, 3, 0.0, 0, 100, requests=6)} == {HOLD}
    # 5 each: 15 fit on 2 (16 sequences), not on 1
    assert run(policy, 3, 0.0, 100, 121, requests=5)[-1][:2] == (2, DOWN)


def test_min_replicas_bounds_a_scale_in_and_a_size_outside_the_bounds_is_restored():
    policy = AutoscalePolicy(CONFIG.model_copy(update={"min_replicas": 2}), 8)
    assert {d.direction for d in run(policy, 2, 0.0, 0, 100)} == {HOLD}
    assert policy.decide(1, loads(1, 0.0), 100.0)[:2] == (2, UP)
    assert policy.decide(6, loads(6, 0.0), 100.0)[:2] == (4, DOWN)


def test_no_decision_while_a_change_is_in_flight_nor_during_the_cooldown():
    policy = AutoscalePolicy(CONFIG, max_num_seqs=8)
    assert run(policy, 2, 3.0, 0, 6)[-1].direction == UP
    policy.begin_change()
    assert {d.reason for d in run(policy, 2, 3.0, 6, 20)} == {"a resize is in flight"}
    policy.end_change(20.0)
    assert {d.reason for d in run(policy, 3, 3.0, 20, 50)} == {"cooling down after a resize"}
    # after the cool-down, the upscale delay runs again from the first tick
    assert [d.direction for d in run(policy, 3, 3.0, 50, 56)] == [HOLD] * 5 + [UP]


def test_scaling_config_rejects_bad_bounds_in_one_sentence_naming_the_option():
    with pytest.raises(ValidationError, match=r"scaling.max_replicas .1. must be at least"):
        ScalingConfig(min_replicas=2, max_replicas=1)
    with pytest.raises(ValidationError, match="min_replicas"):
        ScalingConfig(min_replicas=0)
    with pytest.raises(ValidationError, match="upscale_delay_s"):
        ScalingConfig(upscale_delay_s=-1)
    with pytest.raises(ValidationError, match=r"data_parallel_size .5. must lie between"):
        ClusterConfig(data_parallel_size=5, scaling={"max_replicas": 4})
    assert ClusterConfig().scaling is None


def engine(queries: int, hits: int, step_s: float, waiting: int = 0) -> EngineStats:
    return EngineStats(
        cache=CacheStats(queries=queries, hits=hits),
        transfer=None,
        num_running=1,
        num_waiting=waiting,
        num_preemptions=0,
        steps=StepTimes(num_steps=1, step_seconds=step_s),
    )


def routing(index: int, queued_tokens: int, role: str = "serving") -> ReplicaRoutingStats:
    return ReplicaRoutingStats(
        index, True, False, 0, 0, (0, 0, 0), 0.0, 0, (0,), 0, (0, 0, 0), 0, 0,
        queued_tokens=queued_tokens, role=role,
    )  # fmt: skip


def cluster(engines: dict[int, EngineStats], queued: dict[int, int], roles=None) -> ClusterStats:
    roles = roles or {}
    return ClusterStats(
        [ReplicaStats(i, True, e) for i, e in engines.items()],
        RouterStats(tuple(routing(i, queued[i], roles.get(i, "serving")) for i in engines), 0),
    )


def test_the_estimator_divides_queued_tokens_by_measured_prefill_throughput():
    estimator = QueueEstimator()
    # replica 0: 1,000 tokens computed in 2 s of steps (500/s); replica 1 has not stepped yet
    first = estimator.loads(
        cluster({0: engine(1200, 200, 2.0), 1: engine(0, 0, 0.0, 3)}, {0: 1000, 1: 250})
    )
    assert first == [Load(0, 0, 1, 2.0), Load(1, 3, 1, 0.5)]  # replica 1 takes the mean, 500/s
    # Between two reads: replica 0 computed 300 tokens in 0.1 s (3,000/s)
    second = estimator.loads(
        cluster({0: engine(1500, 200, 2.1), 1: engine(0, 0, 0.0)}, {0: 300, 1: 0})
    )
    assert second[0].queue_s == pytest.approx(0.1)
    # a draining replica is not a serving one: left out
    third = estimator.loads(
        cluster({0: engine(1500, 200, 2.1), 1: engine(0, 0, 0.0)}, {0: 0, 1: 0}, {1: "draining"})
    )
    assert [load.replica_index for load in third] == [0]


class FakeBackend:
    def __init__(self, n: int, queued: int) -> None:
        self.n = n
        self.queued = queued
        self.calls: list[int] = []
        self.tokens = 0

    def num_replicas(self) -> int:
        return self.n

    async def stats(self) -> ClusterStats:
        self.tokens += 1000  # 1,000 tokens per 1 s of steps
        engines = {i: engine(self.tokens, 0, self.tokens / 1000) for i in range(self.n)}
        return cluster(engines, {i: self.queued for i in range(self.n)})

    async def scale(self, n: int) -> None:
        self.calls.append(n)
        self.n = n


def test_the_autoscaler_resizes_the_backend_and_counts_its_decisions_in_the_metrics():
    now = [0.0]
    metrics = StrataMetrics()
    config = CONFIG.model_copy(update={"upscale_delay_s": 2.0})
    autoscaler = Autoscaler(
        config,
        8,
        on_decision=lambda d: metrics.record_autoscale(d.direction, d.num_replicas),
        clock=lambda: now[0],
    )
    backend = FakeBackend(1, queued=2000)  # 2 s of queueing on every replica

    async def ticks(count: int) -> None:
        for _ in range(count):
            await autoscaler.tick(backend)
            now[0] += 1.0

    asyncio.run(ticks(3))
    assert backend.calls == [2]
    text = metrics.render(None).decode()
    assert 'strata_autoscale_decisions_total{direction="hold"} 2.0' in text
    assert 'strata_autoscale_decisions_total{direction="up"} 1.0' in text
    assert "strata_autoscale_desired_replicas 2.0" in text


class GrowingClusterBackend(FakeBackend):
    """Every scale-out waits ``wait_s`` (of the fake clock) for a Ray cluster that does not
    grow, then is refused, as ``ray.scale_out_wait_s`` bounds it."""

    def __init__(self, now: list[float], wait_s: float) -> None:
        super().__init__(1, queued=2000)
        self.now = now
        self.wait_s = wait_s

    async def scale(self, n: int) -> None:
        self.calls.append(n)
        self.now[0] += self.wait_s
        raise ValueError(f"data_parallel_size {n}: ... within ray.scale_out_wait_s")


def test_a_refused_wait_for_the_cluster_to_grow_cools_down_before_the_next_try(caplog):
    now = [0.0]
    config = CONFIG.model_copy(update={"upscale_delay_s": 2.0, "cooldown_s": 30.0})
    autoscaler = Autoscaler(config, 8, clock=lambda: now[0])
    backend = GrowingClusterBackend(now, wait_s=600.0)

    async def ticks(count: int) -> list[str]:
        directions = []
        for _ in range(count):
            directions.append((await autoscaler.tick(backend)).direction)
            now[0] += 1.0
        return directions

    with caplog.at_level("WARNING", logger="cluster.autoscale"):
        first = asyncio.run(ticks(3))  # the third tick asks, waits 600 s, is refused
        assert first == [HOLD, HOLD, UP] and backend.calls == [2] and backend.n == 1
        later = asyncio.run(ticks(32))  # 30 s of cool-down from the refusal, 2 s of delay
    assert later == [HOLD] * 31 + [UP] and backend.calls == [2, 2]
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2  # one warning per try
