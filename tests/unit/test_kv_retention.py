"""Ghost records, the miss-ratio curve and the adaptive retention policy.

The curve is checked against independent runs: the same request sequence replayed on a manager
with 0.5x, 2x or 4x the host blocks, or with write-back, measures the hit rate each estimate
predicts. Pools are tiny and tensor-free; one test runs the real engine.
"""

import itertools
import logging
import random

import pytest

from replicas.config import EngineConfig, KVOffloadConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.engine.request import Request
from replicas.kv.manager import KVCacheManager
from replicas.kv.retention import (
    GHOST_FACTOR,
    HORIZON_FACTOR,
    OFF,
    ON,
    AdaptivePolicy,
    BlockCosts,
    PolicyContext,
    RetentionPolicy,
    RetentionTracker,
    ShadowKey,
    estimated_hit_rates,
    register_policy,
    tuning_hint,
)
from replicas.kv.retention.policy import _REGISTRY as policy_registry
from replicas.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def run(
    manager: KVCacheManager, tokens: list[int], salt: str | None = None, check: bool = True
) -> Request:
    """Admit a request, compute its prompt, finish it, and land the step's transfers (then check
    the manager's integrity, unless ``check`` is off: large replays check once, at the end)."""
    request = Request(f"r{next(_ids)}", tokens, SamplingParams(), BS, cache_salt=salt)
    match = manager.match_prefix(request)
    assert manager.allocate_slots(request, request.num_tokens - match.num_blocks * BS, match)
    manager.record_admission(request, match)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    manager.free(request)
    plan = manager.take_transfer_plan()
    host = manager.host
    for store in plan.stores:  # a store whose hash was already on host would cache nothing
        assert host.blocks[store.dst].block_hash is not None, "a block was stored twice"
    manager.complete_transfer(plan)
    if check:
        manager.check_integrity()
    return request


def blocks(*values: int) -> list[int]:
    """Whole blocks of tokens, one block per value, plus one token (never matched)."""
    return [v for value in values for v in [value] * BS] + [999]


# ---- ghost records -----------------------------------------------------------------------------
def test_ghost_hits_count_blocks_dropped_without_a_host_copy():
    manager = KVCacheManager(4, BS, num_host_blocks=4, write_through_threshold=0)
    run(manager, blocks(1, 2))  # caches [1], [1,2] (+1 block for the last token)
    run(manager, blocks(7, 8, 9))  # evicts both: no host copy (no promotion, no write-back)
    stats = manager.views.retention_stats()["full"]
    assert stats.num_ghosts_dropped == 2 and stats.ghost_hits_dropped == 0
    run(manager, blocks(1, 2, 3))  # both would have been host hits; block 3 was never seen
    stats = manager.views.retention_stats()["full"]
    assert stats.ghost_hits_dropped == 2
    assert stats.ghost_hits_host_evicted == 0
    assert manager.stats.hits == 0  # the real cache served nothing


def test_ghost_walk_stops_at_the_first_block_that_is_nowhere():
    manager = KVCacheManager(4, BS, num_host_blocks=4, write_through_threshold=0)
    run(manager, blocks(1, 2))
    run(manager, blocks(7, 8, 9))
    run(manager, blocks(5, 1, 2))  # block 0 never existed: no prefix could be served
    assert manager.views.retention_stats()["full"].ghost_hits_dropped == 0


def test_ghost_hits_count_blocks_evicted_from_the_host_tier():
    # Threshold 0 stores every block at first write; one host block keeps only the latest.
    manager = KVCacheManager(8, BS, num_host_blocks=1, write_through_threshold="immediate")
    run(manager, blocks(1))
    run(manager, blocks(2))  # the host tier evicts [1]
    manager.reset_prefix_cache("npu")
    run(manager, blocks(1))
    stats = manager.views.retention_stats()["full"]
    assert stats.ghost_hits_host_evicted == 1
    assert stats.ghost_hits_dropped == 0
    assert manager.stats.host_hits == 0


def test_ghost_records_are_bounded_by_the_host_capacity():
    manager = KVCacheManager(2, BS, num_host_blocks=3, write_through_threshold=0)
    for value in range(40):
        run(manager, blocks(100 + value))
    assert manager.views.retention_stats()["full"].num_ghosts_dropped == GHOST_FACTOR * 3


def test_salted_blocks_are_ghosts_of_their_own_tenant_only():
    manager = KVCacheManager(4, BS, num_host_blocks=4, write_through_threshold=0)

    run(manager, blocks(1, 2), "a")
    run(manager, blocks(7, 8, 9), "a")  # evicts tenant a's [1], [1,2]
    run(manager, blocks(1, 2), "b")
    assert manager.views.retention_stats()["full"].ghost_hits_dropped == 0
    run(manager, blocks(1, 2), "a")
    assert manager.views.retention_stats()["full"].ghost_hits_dropped == 2


# ---- the miss-ratio curve ----------------------------------------------------------------------
def workload(seed: int, n: int = 1500, num_prefixes: int = 40, zipf: float = 1.0) -> list[list]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(1000) for _ in range(rng.randint(3, 8) * BS)] for _ in range(num_prefixes)
    ]
    weights = [1 / (i + 1) ** zipf for i in range(num_prefixes)]
    requests = []
    for _ in range(n):
        prefix = rng.choices(prefixes, weights)[0]
        requests.append(prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 2 * BS))])
    return requests


def replay(requests: list[list], num_host_blocks: int, **kwargs) -> KVCacheManager:
    manager = KVCacheManager(24, BS, num_host_blocks=num_host_blocks, **kwargs)
    for tokens in requests:
        run(manager, tokens)
    return manager


def host_hit_rate(manager: KVCacheManager) -> float:
    return manager.stats.host_hits / manager.stats.queries


@pytest.mark.parametrize("seed,zipf", [(0, 1.0), (1, 0.6), (2, 1.2)])
@pytest.mark.parametrize("write_back", [False, True])
def test_the_curve_predicts_runs_with_other_capacities_and_write_back(seed, zipf, write_back):
    requests = workload(seed, zipf=zipf)
    capacity = 40
    manager = replay(requests, capacity, write_back=write_back)
    estimates = estimated_hit_rates(manager.views.retention_stats()["full"], manager.stats.queries)
    running = ON if write_back else OFF
    assert estimates[ShadowKey(1.0, running)] == pytest.approx(host_hit_rate(manager))
    points = [ShadowKey(f, running) for f in (0.5, 2.0, 4.0)]
    points.append(ShadowKey(1.0, OFF if write_back else ON))
    for key in points:
        measured = replay(
            requests, int(key.capacity_factor * capacity), write_back=key.write_back == ON
        )
        assert abs(estimates[key] - host_hit_rate(measured)) <= 0.03, key
    assert len({round(estimates[k], 3) for k in points}) > 1  # the curve is not flat here


def test_the_curve_on_the_real_engine_predicts_runs_with_twice_the_memory_and_no_write_back():
    rng = random.Random(5)
    prefixes = [[rng.randrange(256) for _ in range(rng.randint(2, 5) * 16)] for _ in range(12)]
    prompts = [
        rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randint(1, 20))]
        for _ in range(90)
    ]

    def engine(ratio: float, write_back: bool) -> Engine:
        config = EngineConfig(
            model="tiny",
            num_npu_blocks=20,
            max_model_len=160,
            scheduler_config=SchedulerConfig(
                kv_offload_config=KVOffloadConfig(
                    enabled=True, host_memory_ratio=ratio, write_back=write_back
                )
            ),
        )
        return Engine(config)

    def serve(engine: Engine) -> Engine:
        for start in range(0, len(prompts), 3):  # three at a time
            for n in range(start, min(start + 3, len(prompts))):
                engine.add_request(f"p{n}", prompts[n], SamplingParams(max_tokens=2))
            while engine.has_unfinished_requests():
                engine.step()
        return engine

    base = serve(engine(1.0, True))
    stats = base.kv_cache.stats
    estimates = estimated_hit_rates(base.stats().retention["full"], stats.queries)
    assert estimates[ShadowKey(1.0, ON)] == pytest.approx(stats.host_hits / stats.queries)
    assert estimates[ShadowKey(2.0, ON)] > estimates[ShadowKey(1.0, ON)] + 0.1  # not flat
    for key, ratio, write_back in (
        (ShadowKey(2.0, ON), 2.0, True),
        (ShadowKey(1.0, OFF), 1.0, False),
    ):
        measured = serve(engine(ratio, write_back)).kv_cache.stats
        assert abs(estimates[key] - measured.host_hits / measured.queries) <= 0.03, key


def test_shadows_beyond_the_memory_bound_are_not_kept():
    tracker = RetentionTracker("fixed", PolicyContext(100), sample_rate=1.0, max_shadow_blocks=300)
    # 0.5x + 1x + 1x (write-back on) fit in 250 blocks; 2x would need 450
    assert sorted(tracker.shadow_keys) == [
        ShadowKey(0.5, OFF),
        ShadowKey(1.0, OFF),
        ShadowKey(1.0, ON),
    ]


# ---- the sampled curve -------------------------------------------------------------------------
def replay_fast(requests: list[list], num_npu_blocks: int, num_host_blocks: int, **kwargs):
    """``replay`` on larger pools, without the per-request integrity check."""
    manager = KVCacheManager(num_npu_blocks, BS, num_host_blocks=num_host_blocks, **kwargs)
    for tokens in requests:
        run(manager, tokens, check=False)
    manager.check_integrity()
    return manager


@pytest.mark.parametrize("seed,zipf", [(0, 1.0), (1, 0.6), (2, 1.2)])
@pytest.mark.parametrize("write_back", [False, True])
def test_the_sampled_curve_follows_the_exact_one_and_the_measured_runs(seed, zipf, write_back):
    # 2048 host blocks: the default rate samples half the hashes (1024 in the 1x shadow)
    requests = workload(seed, n=5000, num_prefixes=600, zipf=zipf)
    capacity, npu = 2048, 300

    def curve(manager: KVCacheManager) -> dict[ShadowKey, float]:
        return estimated_hit_rates(manager.views.retention_stats()["full"], manager.stats.queries)

    sampled = replay_fast(requests, npu, capacity, write_back=write_back)
    exact = replay_fast(requests, npu, capacity, write_back=write_back, curve_sample_rate=1.0)
    assert sampled.stats == exact.stats  # sampling changes no decision of the fixed policy
    estimates, exact_estimates = curve(sampled), curve(exact)
    assert estimates.keys() == exact_estimates.keys()
    assert estimates != exact_estimates  # sampled: the estimates differ, a little
    for key, estimate in estimates.items():
        assert abs(estimate - exact_estimates[key]) <= 0.02, key
        if key.capacity_factor == 1.0 and key.write_back == (ON if write_back else OFF):
            measured = sampled
        else:
            measured = replay_fast(
                requests,
                npu,
                int(key.capacity_factor * capacity),
                write_back=key.write_back == ON,
                curve_sample_rate=1.0,
            )
        assert abs(estimate - host_hit_rate(measured)) <= 0.03, key


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_the_default_sample_holds_one_percent_of_a_large_host_tier(policy):
    large = RetentionTracker(policy, PolicyContext(2_000_000))
    assert large.curve.max_tracked() <= 0.01 * 2_000_000
    # below the floor's reach the 1x shadow samples 1024 blocks; below 1024 blocks, every hash
    small = RetentionTracker(policy, PolicyContext(100_000))
    assert small.curve.sample_rate == pytest.approx(1024 / 100_000)
    running = ShadowKey(1.0, small.policy.curve_name)
    assert small.curve.max_tracked() < 0.2 * 100_000
    assert RetentionTracker(policy, PolicyContext(1000)).curve.sample_rate == 1.0
    # fed far more evictions than it holds, it stays within its bounds
    rng = random.Random(0)
    for _ in range(30_000):
        block_hash = rng.randbytes(16)
        small.promotion_candidate(block_hash)
        small.npu_evicted(block_hash, num_hits=2, kept=False)
        small.host_evicted(block_hash)
    assert 0 < small.curve.num_tracked() <= small.curve.max_tracked()
    assert running in small.shadow_keys


def test_a_hash_is_sampled_by_its_value_and_counts_scale_by_the_rate():
    tracker = RetentionTracker("fixed", PolicyContext(100), sample_rate=0.25)
    rate = tracker.curve.sample_rate
    hashes = [bytes([n]) + bytes(15) for n in range(256)]  # first byte 0..255: a quarter below
    sampled = [h for h in hashes if tracker.curve.is_sampled(h)]
    assert sampled == hashes[:64] and rate == 0.25
    for block_hash in hashes:
        tracker.npu_evicted(block_hash, num_hits=0, kept=False)
    tracker.admitted(hashes, [False] * 256, [False] * 256)  # every sampled one a ghost hit
    stats = tracker.snapshot(BS)
    assert stats.ghost_hits_dropped == 256 and stats.num_ghosts_dropped == 0


# ---- the adaptive policy -----------------------------------------------------------------------
def test_adaptive_stops_storing_blocks_that_never_return():
    rng = random.Random(3)
    one_off = [[rng.randrange(1000) for _ in range(6 * BS)] + [1] for _ in range(400)]
    write_back = replay(one_off, 40, write_back=True)
    adaptive = replay(one_off, 40, retention="adaptive")
    assert write_back.stats.blocks_stored > 1000
    assert adaptive.stats.blocks_stored <= 0.1 * write_back.stats.blocks_stored
    retention = adaptive.views.retention_stats()["full"]
    assert retention.adaptive_skips > 10 * retention.adaptive_stores


def test_adaptive_stores_blocks_that_return_after_eviction():
    # Prefixes cycle through a working set larger than the NPU tier: every evicted block returns.
    prefixes = [[p] * (5 * BS) for p in range(12)]
    requests = [prefixes[n % 12] + [n % 7 + 500] for n in range(600)]
    adaptive = replay(requests, 80, retention="adaptive")
    write_back = replay(requests, 80, write_back=True)
    default = replay(requests, 80)
    # it learns from the first evictions' reuse: a few points behind write-back, far ahead of
    # the default policy, which loses every prefix evicted before its second hit
    assert host_hit_rate(adaptive) >= host_hit_rate(write_back) - 0.05
    assert host_hit_rate(adaptive) > host_hit_rate(default) + 0.2


def test_an_eviction_counts_against_its_kind_only_once_reused_or_past_the_horizon():
    tracker = AdaptivePolicy(PolicyContext(num_host_blocks=100))
    horizon = int(HORIZON_FACTOR * 100)
    hashes = [bytes([n]) * 16 for n in range(60)]
    for block_hash in hashes[: horizon - 10]:
        tracker.npu_evicted(block_hash, num_hits=0, kept=False)
    assert tracker.reuse_probability(0) == 0.5  # nothing resolved: the prior alone
    for block_hash in hashes[horizon - 10 :]:
        tracker.npu_evicted(block_hash, num_hits=0, kept=False)
    expired = len(hashes) - horizon  # evictions older than the horizon, none reused
    assert tracker.reuse_probability(0) == pytest.approx(0.5 / (expired + 1))
    tracker.admitted([hashes[0]], [False], [False])  # a reuse after the horizon: one more reuse
    assert tracker.reuse_probability(0) == pytest.approx(1.5 / (expired + 1))
    tracker.admitted([hashes[-1]], [False], [False])  # an open one: reused and now resolved
    assert tracker.reuse_probability(0) == pytest.approx(2.5 / (expired + 2))


def test_adaptive_stores_a_kind_whose_reuse_is_still_pending():
    # 16 prefixes cycle through an NPU tier of 6 and a host tier that holds them all: each
    # block returns 10 prefixes after its eviction, later than the first evictions' decisions.
    prefixes = [[p] * (5 * BS) for p in range(16)]
    requests = [prefixes[n % 16] + [n % 7 + 500] for n in range(320)]
    adaptive = replay(requests, 120, retention="adaptive")
    write_back = replay(requests, 120, write_back=True)
    assert host_hit_rate(write_back) > 0.5
    assert host_hit_rate(adaptive) >= host_hit_rate(write_back) - 0.01


def test_adaptive_never_stores_when_a_reload_costs_more_than_a_recompute():
    manager = KVCacheManager(
        24, BS, num_host_blocks=80, write_through_threshold=0, retention="adaptive"
    )
    manager.set_block_costs(BlockCosts(recompute_s=1.0, reload_s=2.0, store_s=0.1))
    for n in range(300):
        run(manager, [n % 12] * (5 * BS) + [7])
    assert manager.stats.blocks_stored == 0


def test_adaptive_stores_a_promoted_block_when_evicted_and_decides_the_rest_at_eviction():
    requests = workload(4, n=800)
    adaptive = replay(requests, 40, retention="adaptive")
    default = replay(requests, 40)
    assert default.stats.write_through_promotions > 0 and default.stats.write_backs == 0
    stats, retention = adaptive.stats, adaptive.views.retention_stats()["full"]
    assert stats.write_through_promotions == 0  # every store is made at eviction
    assert stats.blocks_stored == stats.write_backs == retention.adaptive_stores > 0
    assert retention.adaptive_skips > 0


def adaptive_store_pays_never(**options: object) -> KVCacheManager:
    """A store costs nearly a recompute: no bucket's reuse pays for it."""
    manager = KVCacheManager(24, BS, num_host_blocks=80, **options)
    manager.set_block_costs(BlockCosts(recompute_s=1.0, reload_s=0.05, store_s=0.9))
    return manager


def test_adaptive_defers_promotion_to_eviction():
    # Prefix A (5 blocks) is requested three times: every block reaches the threshold (2 hits).
    # The default policy copies it then; the adaptive one stores it only when the NPU tier
    # evicts it, whatever its bucket's reuse (here a store pays for no bucket).
    prefix = [1] * (5 * BS)
    default = adaptive_store_pays_never(write_through_threshold=2)
    adaptive = adaptive_store_pays_never(write_through_threshold=2, retention="adaptive")
    for manager in (default, adaptive):
        for n in range(3):
            run(manager, prefix + [900 + n])
    assert default.stats.blocks_stored == 5
    assert adaptive.stats.blocks_stored == 0  # still on the NPU tier: no copy yet
    for n in range(12):  # one-off prompts push A out of the NPU tier
        run(adaptive, [100 + n] * (5 * BS) + [7])
    assert adaptive.stats.blocks_stored == adaptive.stats.write_backs == 5  # A, and only A
    again = run(adaptive, prefix + [950])
    assert adaptive.stats.host_hits == 5 * BS and again.num_cached_tokens == 5 * BS


def test_defaults_are_unchanged():
    config = KVOffloadConfig(enabled=True, host_memory_ratio=1.0)
    assert (config.retention, config.write_through_threshold, config.write_back) == (
        "fixed",
        2,
        False,
    )


def test_adaptive_with_write_back_fails_naming_both_options():
    with pytest.raises(ValueError, match=r"--experimental-kv-offload-retention.*write-back"):
        KVOffloadConfig(enabled=True, host_memory_ratio=1.0, retention="adaptive", write_back=True)


def test_an_unknown_retention_is_refused():
    with pytest.raises(ValueError, match="retention"):
        KVOffloadConfig(enabled=True, host_memory_ratio=1.0, retention="lru")
    with pytest.raises(ValueError, match="retention must be one of"):
        KVCacheManager(4, BS, num_host_blocks=4, retention="lru")


# ---- a policy from outside the package ---------------------------------------------------------
class EvenHashPolicy(RetentionPolicy):
    """Test-only: at NPU eviction, store exactly the blocks whose hash starts with an even byte;
    promotion stores nothing."""

    curve_name = "even"
    decides_at_eviction = True

    def __init__(self, context: PolicyContext) -> None:
        self.num_host_blocks = context.num_host_blocks

    def should_store(self, block_hash: bytes, num_hits: int, host_full: bool) -> bool:
        return block_hash[0] % 2 == 0


@pytest.fixture
def even_hash_policy():
    """EvenHashPolicy registered for one test, then removed, so that the registry other tests
    see (the config's choices among them) is the package's."""
    register_policy("test-even-hashes")(EvenHashPolicy)
    yield "test-even-hashes"
    policy_registry.pop("test-even-hashes")


def test_a_policy_registered_from_a_test_file_runs_through_the_manager(even_hash_policy):
    prefixes = [[p] * (5 * BS) for p in range(12)]
    requests = [prefixes[n % 12] + [n % 7 + 500] for n in range(300)]
    manager = replay(requests, 80, retention=even_hash_policy)
    stats, retention = manager.stats, manager.views.retention_stats()["full"]
    host_hashes = [b.block_hash for b in manager.host.blocks if b.block_hash is not None]
    assert host_hashes and all(h[0] % 2 == 0 for h in host_hashes)
    assert stats.write_through_promotions == 0  # every store decided at eviction
    assert stats.blocks_stored == stats.write_backs == retention.adaptive_stores > 0
    assert retention.adaptive_skips > 0
    # the curve's shadows follow the new policy: its 1x shadow is the real tier
    estimates = estimated_hit_rates(retention, stats.queries)
    assert stats.host_hits > 0
    assert estimates[ShadowKey(1.0, "even")] == pytest.approx(host_hit_rate(manager))
    assert {ShadowKey(1.0, OFF), ShadowKey(1.0, ON), ShadowKey(2.0, "even")} <= estimates.keys()


# ---- the tuning hint ---------------------------------------------------------------------------
def test_the_hint_points_to_write_back_when_dropped_blocks_return():
    prefixes = [[p] * (5 * BS) for p in range(12)]
    requests = [prefixes[n % 12] + [n % 7 + 500] for n in range(300)]
    manager = replay(requests, 80, write_through_threshold=0)
    line = tuning_hint("full", manager.views.retention_stats()["full"], manager.stats.queries, OFF)
    assert "write-back would have served" in line
    assert "--experimental-kv-offload-write-back" in line


def test_the_hint_says_when_write_back_hurts():
    requests = workload(0)
    manager = replay(requests, 40, write_back=True)
    stats = manager.views.retention_stats()["full"]
    rates = estimated_hit_rates(stats, manager.stats.queries)
    assert rates[ShadowKey(1.0, OFF)] > rates[ShadowKey(1.0, ON)] + 0.01  # as measured above
    line = tuning_hint("full", stats, manager.stats.queries, ON)
    assert "write-back costs" in line or "2x host memory would add" in line


def test_the_engine_logs_its_hint_periodically(caplog):
    config = EngineConfig(
        model="tiny",
        num_npu_blocks=12,
        scheduler_config=SchedulerConfig(
            kv_offload_config=KVOffloadConfig(enabled=True, host_memory_ratio=1.0)
        ),
    )
    engine = Engine(config)
    engine.meter.tuning_hint_interval_s = 0.0
    with caplog.at_level(logging.INFO, logger="replicas.engine.step_meter"):
        engine.add_request("a", list(range(40)), SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
    hints = [r.getMessage() for r in caplog.records if "host tier [full]" in r.getMessage()]
    assert hints and "(write-back off)" in hints[0]


# ---- one name in Python, YAML and CLI ----------------------------------------------------------
def test_adaptive_retention_is_named_alike_in_yaml_and_cli(tmp_path):
    from cluster.cli import build_config, build_parser, main

    def parse(*argv: str):
        return build_config(build_parser().parse_args(["serve", *argv]))

    flags = ("--experimental-kv-offload-host-memory-ratio", "1")
    by_flag = parse(*flags, "--experimental-kv-offload-retention", "adaptive")
    path = tmp_path / "adaptive.yaml"
    path.write_text(
        "scheduler:\n  kv_offload_config:\n    enabled: true\n    host_memory_ratio: 1\n"
        "    retention: adaptive\n"
    )
    by_file = parse("--config", str(path))
    for config in (by_flag, by_file):
        assert config.scheduler.kv_offload_config.retention == "adaptive"
    assert parse(*flags).scheduler.kv_offload_config.retention == "fixed"
    argv = ["serve", *flags, "--experimental-kv-offload-write-back"]
    assert main([*argv, "--experimental-kv-offload-retention", "adaptive"]) == 2


def test_the_hint_interval_is_positive_or_none():
    assert KVOffloadConfig(tuning_hint_interval_s=None).tuning_hint_interval_s is None
    with pytest.raises(ValueError, match="tuning_hint_interval_s"):
        KVOffloadConfig(tuning_hint_interval_s=0)


def test_a_replica_process_sends_its_info_records_to_stderr():
    """What a replica actor logs (its hints among it) reaches stderr, which Ray forwards to the
    server's log; run in a fresh interpreter, as an actor process is."""
    import subprocess
    import sys

    code = (
        "import logging; from replicas.actor import _log_to_the_driver; _log_to_the_driver(); "
        "logging.getLogger('replicas.engine.engine').info('host tier [full]: a hint')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "replicas.engine.engine host tier [full]: a hint" in result.stderr
