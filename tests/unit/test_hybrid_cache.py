"""Hybrid attention: the safe-prefix rule, eager release, per-type capacity, exact outputs."""

import itertools
import random

import pytest
import torch

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.config import EngineConfig
from replicas.engine.request import Request
from replicas.kv.capacity import plan_host_blocks, plan_npu_blocks, plan_replica_offload
from replicas.kv.events import Tier
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import CacheTypeSpec
from replicas.model import load_model

BS = 4
WINDOW = 8  # a token at position p sees p-7 .. p: the window spans the last two blocks
_ids = itertools.count()


def manager(**kwargs) -> KVCacheManager:
    host = kwargs.pop("num_host_blocks", 0)
    return KVCacheManager(
        block_size=BS,
        cache_types=[
            CacheTypeSpec("full", 16, host),
            CacheTypeSpec("sliding", 16, host, WINDOW),
        ],
        **kwargs,
    )


def run(m: KVCacheManager, tokens: list[int]) -> Request:
    request = Request(f"h{next(_ids)}", tokens, SamplingParams(), BS)
    match = m.match_prefix(request)
    assert m.allocate_slots(request, request.num_tokens - match.num_blocks * BS, match)
    m.record_admission(request, match)
    request.num_computed_tokens = request.num_tokens
    m.cache_blocks(request)
    m.free(request)
    m.check_integrity()
    return request


def drop_from_npu(m: KVCacheManager, cache_type: int, block_hash: bytes) -> None:
    pool = m._cache_types[cache_type].npu
    block = pool.lookup(block_hash)
    pool.touch([block])
    pool._uncache(pool.blocks[block])
    pool.free([block])


PROMPT = list(range(13))  # 3 full blocks + 1 token


def test_full_window_present_reuses_every_block():
    m = manager()
    run(m, PROMPT)
    again = Request("again", PROMPT, SamplingParams(), BS)
    match = m.match_prefix(again)
    assert match.num_blocks == 3
    assert match.cache_types["sliding"].first_block == 1  # only blocks 1..2 are needed


def test_window_on_host_only_is_reloaded_block_for_block():
    m = manager(num_host_blocks=16, write_through_threshold="immediate")
    run(m, PROMPT)
    m.complete_transfer(m.take_transfer_plan())
    m.reset_prefix_cache("npu")
    request = run(m, [*PROMPT[:12], 99])
    assert request.num_host_cached_tokens == 12 and request.num_npu_cached_tokens == 0
    plan = m.take_transfer_plan()
    loads = {t: sorted(c.src for c in plan.loads if c.cache_type == t) for t in ("full", "sliding")}
    assert len(loads["full"]) == 3  # every global block
    assert len(loads["sliding"]) == 2  # exactly the window
    m.complete_transfer(plan)
    m.check_integrity()


def test_missing_window_falls_back_to_the_longest_safe_prefix():
    m = manager()
    first = run(m, PROMPT)
    drop_from_npu(m, 1, first.block_hashes[2])  # sliding KV of block 2 is gone
    request = Request("shorter", PROMPT, SamplingParams(), BS)
    match = m.match_prefix(request)
    # Global KV matches 3 blocks, but the window ending at block 3 needs sliding block 2.
    assert m.views.usage()["full"].of(Tier.NPU).num_cached >= 3
    assert match.num_blocks == 2
    assert match.cache_types["sliding"].first_block == 0  # blocks 0..1 cover the window at 8


def test_raw_token_match_longer_than_the_safe_prefix():
    m = manager()
    first = run(m, list(range(25)))  # 6 full blocks
    drop_from_npu(m, 1, first.block_hashes[4])
    drop_from_npu(m, 1, first.block_hashes[1])
    match = m.match_prefix(Request("raw", list(range(25)), SamplingParams(), BS))
    # L=6 needs sliding 4..5 (4 gone); L=5 needs 3..4; L=4 needs 2..3 -> safe.
    assert match.num_blocks == 4


def test_sliding_blocks_leave_with_the_window_and_stay_cached():
    m = manager()
    request = Request("long", list(range(21)), SamplingParams(), BS)
    assert m.allocate_slots(request, 21)
    request.num_computed_tokens = 21
    m.cache_blocks(request)
    sliding = m.block_tables("long")["sliding"]
    assert sliding[:3] == [None, None, None]  # position 21 sees blocks 3.. only
    assert all(b is not None for b in sliding[3:])
    usage = m.views.usage()
    assert usage["sliding"].of(Tier.NPU).num_used == 3 and usage["full"].of(Tier.NPU).num_used == 6
    assert usage["sliding"].of(Tier.NPU).num_cached == 5  # released blocks remain reusable
    m.free(request)
    m.check_integrity()


def test_npu_split_and_host_capacity_per_cache_type():
    specs = load_model("tiny-hybrid", torch.device("cpu")).model.kv_cache_specs(torch.float32)
    full_bytes, sliding_bytes = (s.block_bytes(16) for s in specs.values())
    assert (full_bytes, sliding_bytes) == (32768, 65536)  # 2 global vs 4 sliding layers
    config = EngineConfig(
        model="tiny-hybrid",
        num_npu_blocks=100,
        max_model_len=1600,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=256),
    )
    # Per request: 100 global blocks vs ceil((64 - 1 + 256) / 16) + 1 = 21 sliding blocks.
    npu = plan_npu_blocks(specs, config, 16384)
    assert npu == {"full": 100, "sliding": 21}
    ratio = plan_host_blocks(
        KVOffloadConfig(enabled=True, host_memory_ratio=2.5),
        npu,
        {"full": full_bytes, "sliding": sliding_bytes},
    )
    assert ratio == {"full": 250, "sliding": 52}
    # 10 MiB over dp 2: 5 MiB per replica, split 3276800 : 1376256 by NPU KV memory.
    offload = KVOffloadConfig(enabled=True, host_memory_bytes=10 * 2**20)
    share = plan_replica_offload(offload, 2, full_bytes + sliding_bytes)
    assert share.host_memory_bytes == 5 * 2**20
    per_type = plan_host_blocks(share, npu, {"full": full_bytes, "sliding": sliding_bytes})
    assert per_type == {
        "full": 5 * 2**20 * 3276800 // 4653056 // 32768,
        "sliding": 5 * 2**20 * 1376256 // 4653056 // 65536,
    }
    assert per_type == {"full": 112, "sliding": 23}
    with pytest.raises(ValueError, match="no host block for cache type 'sliding'"):
        plan_host_blocks(
            KVOffloadConfig(enabled=True, host_memory_bytes=100_000),
            npu,
            {"full": full_bytes, "sliding": sliding_bytes},
        )


def test_tiny_hybrid_outputs_match_cold_runs_through_eviction_and_reload():
    rng = random.Random(3)
    base = [rng.randrange(256) for _ in range(240)]
    prompts = [
        base[: rng.randrange(90, 240)] + [rng.randrange(256) for _ in range(5)] for _ in range(8)
    ]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cold = LLM(
        "tiny-hybrid",
        scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
    )
    reference = [o.token_ids for o in cold.generate(prompts, params)]
    llm = LLM(
        "tiny-hybrid",
        num_npu_blocks=40,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=96,
            kv_offload_config=KVOffloadConfig(
                enabled=True, host_memory_ratio=4.0, write_through_threshold="immediate"
            ),
        ),
    )
    outputs = [llm.generate(p, params) for p in prompts]
    assert [o.token_ids for o in outputs] == reference
    assert sum(o.num_cached_tokens for o in outputs) > 0
    llm.reset_prefix_cache("npu")
    reloaded = [llm.generate(p, params) for p in prompts]
    assert [o.token_ids for o in reloaded] == reference
    first = reloaded[0]
    assert first.num_cached_tokens_in(Tier.HOST) == first.num_cached_tokens > 0
    full_npu, full_host = first.cached_tokens_by_cache_type["full"]
    sliding_npu, sliding_host = first.cached_tokens_by_cache_type["sliding"]
    assert (full_npu, full_host) == (0, first.num_cached_tokens)
    assert 0 < sliding_npu + sliding_host <= 64 + 16  # only the window
    per_type = llm.stats().cache.by_cache_type
    assert per_type["full"].blocks_loaded > 0 and per_type["sliding"].blocks_loaded > 0
    llm.check_integrity()


def test_eager_release_bounds_sliding_usage_during_a_long_generation():
    llm = LLM("tiny-hybrid", num_npu_blocks=64)
    engine = llm.engine
    engine.add_request("g", list(range(40)), SamplingParams(max_tokens=400, ignore_eos=True))
    peak_sliding = peak_full = 0
    while engine.has_unfinished_requests():
        engine.step()
        usage = engine.kv_cache.views.usage()
        peak_sliding = max(peak_sliding, usage["sliding"].of(Tier.NPU).num_used)
        peak_full = max(peak_full, usage["full"].of(Tier.NPU).num_used)
    window_blocks = 64 // 16
    assert peak_sliding <= window_blocks + 1
    assert peak_full == (40 + 400 - 1) // 16 + 1  # global KV of every token stays
    llm.check_integrity()
