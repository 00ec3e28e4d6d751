"""The host tier on the real engine: reload correctness and a property test of random traffic."""

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.events import Tier
from replicas.kv.hashing import block_hashes

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def offload(**kwargs) -> SchedulerConfig:
    return SchedulerConfig(kv_offload_config=KVOffloadConfig(enabled=True, **kwargs))


def assert_host_copies_match(engine: Engine) -> None:
    """Every block resident in both tiers holds the same bytes in both."""
    manager, transfer = engine.kv_cache, engine.transfer
    for block_hash in manager.host.cached_hashes():
        host_id = manager.host.lookup(block_hash)
        npu_id = manager.npu.lookup(block_hash)
        if npu_id is None or manager.host.blocks[host_id].ref_count:
            continue  # host only, or a transfer still in flight
        for cache_type, npu in transfer.npu_caches.items():
            assert torch.equal(npu[npu_id], transfer.host_caches[cache_type][host_id]), block_hash


def test_promoted_prefix_reloads_from_host_with_identical_output():
    rng = random.Random(1)
    prefix = [rng.randrange(256) for _ in range(200)]
    prompt = [*prefix, 1, 2, 3]
    cold = LLM(
        "tiny",
        scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
    )
    reference = cold.generate(prompt, GREEDY).token_ids

    llm = LLM(
        "tiny",
        num_npu_blocks=40,
        scheduler_config=offload(host_memory_ratio=2.0, write_through_threshold=1),
    )
    llm.generate([*prefix, 9], GREEDY)
    llm.generate([*prefix, 8], GREEDY)  # first later hit: promoted to host
    assert llm.stats().cache.write_through_promotions == 12
    # Unrelated traffic pushes the prefix out of the NPU tier.
    for i in range(5):
        llm.generate([rng.randrange(256) for _ in range(180)] + [i], GREEDY)
    first_block = block_hashes(prompt, 16)[0]
    assert llm.engine.kv_cache.npu.lookup(first_block) is None
    output = llm.generate(prompt, GREEDY)
    assert output.num_cached_tokens_by_tier == (0, 192, 0)
    assert output.num_cached_tokens == 192
    assert output.token_ids == reference
    stats = llm.stats()
    assert stats.cache.host_hits == 192 and stats.cache.blocks_loaded == 12
    assert stats.transfer.bytes_loaded == 12 * llm.engine.runner.block_bytes
    assert_host_copies_match(llm.engine)
    llm.check_integrity()


def test_write_back_keeps_a_working_set_larger_than_the_npu_tier():
    rng = random.Random(2)
    prefixes = [[rng.randrange(256) for _ in range(96)] for _ in range(6)]  # 36 blocks in all
    cold = LLM(
        "tiny",
        scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
    )
    llm = LLM(
        "tiny",
        num_npu_blocks=16,
        scheduler_config=offload(host_memory_ratio=4.0, write_through_threshold=0, write_back=True),
    )
    for p in prefixes:
        llm.generate([*p, 0], GREEDY)
    outputs = [llm.generate([*p, 1], GREEDY) for p in prefixes]
    assert llm.stats().cache.write_backs > 0
    assert sum(o.num_cached_tokens_in(Tier.HOST) for o in outputs) > 0
    for p, output in zip(prefixes, outputs):
        assert output.token_ids == cold.generate([*p, 1], GREEDY).token_ids
        assert output.num_cached_tokens == 96
    assert_host_copies_match(llm.engine)
    llm.check_integrity()


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("reset"), st.sampled_from(["npu", "host", "all"])),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(operation, min_size=1, max_size=25),
    threshold=st.sampled_from([0, "immediate", 1, 2]),
    policy=st.sampled_from(["fixed", "write-back", "adaptive"]),
)
def test_random_traffic_keeps_integrity_and_host_copies_exact(ops, threshold, policy):
    engine = _small_engine(threshold, policy)
    prefixes = [[p * 50 + i % 50 for i in range(48)] for p in range(4)]
    live: list[str] = []
    for n, op in enumerate(ops):
        if op[0] == "add":
            _, which, suffix, max_tokens = op
            prompt = prefixes[which] + [(n * 7 + i) % 256 for i in range(suffix)]
            engine.add_request(
                f"q{n}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
            live.append(f"q{n}")
        elif op[0] == "step":
            for _ in range(op[1]):
                for output in engine.step():
                    if output.finished:
                        live.remove(output.request_id)
        elif op[0] == "abort" and live:
            engine.abort_request(live.pop(op[1] % len(live)))
        elif op[0] == "reset":
            engine.reset_prefix_cache(op[1])
        engine.check_integrity()
        assert engine.kv_cache.npu.num_used <= engine.kv_cache.npu.num_blocks
        assert engine.kv_cache.host.num_cached <= engine.kv_cache.host.num_blocks
        assert_host_copies_match(engine)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.kv_cache.npu.num_used == 0
    assert engine.kv_cache.host.num_used == 0  # nothing left locked in flight


_ENGINES: dict[tuple, Engine] = {}


def _small_engine(threshold: int | str, policy: str) -> Engine:
    from replicas.config import EngineConfig

    config = EngineConfig(
        model="tiny",
        num_npu_blocks=14,
        max_model_len=120,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=48,
            kv_offload_config=KVOffloadConfig(
                enabled=True,
                host_memory_ratio=1.0,
                write_through_threshold=threshold,
                write_back=policy == "write-back",
                retention="adaptive" if policy == "adaptive" else "fixed",
            ),
        ),
    )
    key = (threshold, policy)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(config)
    engine = Engine(config, loaded=_ENGINES[key].loaded)
    return engine
