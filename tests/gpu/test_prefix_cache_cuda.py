"""Prefix caching with the host tier on the GPU: greedy outputs equal cold runs (caching off)
with ``tiny``, ``tiny-hybrid`` and the real default model, through NPU hits, NPU eviction and
host reload. ``device="cpu"`` runs the same checks on the CPU."""

import random

import pytest
import torch

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.kv.events import Tier
from replicas.kv.hashing import block_hashes
from tests.gpu.devices import DEVICES, SLOW_ON_CPU

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
COLD = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))


def offload(**kwargs) -> SchedulerConfig:
    max_tokens = kwargs.pop("max_num_batched_tokens", 2048)
    return SchedulerConfig(
        max_num_batched_tokens=max_tokens,
        kv_offload_config=KVOffloadConfig(enabled=True, **kwargs),
    )


def assert_host_copies_match(llm: LLM) -> None:
    """Every block resident in both tiers holds the same values in both. Not the same bytes: a
    block the cache never reuses (the one holding a prompt's last token, or one beyond the
    sliding window's safe prefix) is computed again in another batch shape, which changes the
    last bits (the transfer tests check that copies are byte-exact)."""
    manager, transfer = llm.engine.kv_cache, llm.engine.transfer
    for cache_type in manager._cache_types:
        for block_hash in cache_type.host.cached_hashes():
            host_id = cache_type.host.lookup(block_hash)
            npu_id = cache_type.npu.lookup(block_hash)
            if npu_id is None or cache_type.host.blocks[host_id].ref_count:
                continue  # host only, or a transfer still in flight
            npu_block = transfer.npu_caches[cache_type.name][npu_id].cpu()
            host_block = transfer.host_caches[cache_type.name][host_id]
            assert torch.allclose(npu_block, host_block, rtol=1e-3, atol=1e-3), block_hash


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_promoted_prefix_reloads_from_host_with_the_cold_output(device):
    rng = random.Random(1)
    prefix = [rng.randrange(256) for _ in range(200)]
    prompt = [*prefix, 1, 2, 3]
    reference = LLM("tiny", device=device, scheduler_config=COLD).generate(prompt, GREEDY)
    llm = LLM(
        "tiny",
        device=device,
        num_npu_blocks=40,
        scheduler_config=offload(host_memory_ratio=2.0, write_through_threshold=1),
    )
    assert str(llm.engine.device).startswith(device)
    llm.generate([*prefix, 9], GREEDY)
    npu_hit = llm.generate([*prefix, 8], GREEDY)  # first later hit: promoted to host
    assert npu_hit.num_cached_tokens_in(Tier.NPU) == 192
    assert llm.stats().cache.write_through_promotions == 12
    for i in range(5):  # unrelated traffic pushes the prefix out of the NPU tier
        llm.generate([rng.randrange(256) for _ in range(180)] + [i], GREEDY)
    assert llm.engine.kv_cache.npu.lookup(block_hashes(prompt, 16)[0]) is None
    output = llm.generate(prompt, GREEDY)
    assert output.num_cached_tokens_by_tier == (0, 192, 0)
    assert output.token_ids == reference.token_ids
    assert llm.stats().cache.blocks_loaded == 12
    assert_host_copies_match(llm)
    llm.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_write_back_working_set_larger_than_the_npu_tier(device):
    rng = random.Random(2)
    prefixes = [[rng.randrange(256) for _ in range(96)] for _ in range(6)]  # 36 blocks in all
    cold = LLM("tiny", device=device, scheduler_config=COLD)
    llm = LLM(
        "tiny",
        device=device,
        num_npu_blocks=16,
        scheduler_config=offload(host_memory_ratio=4.0, write_through_threshold=0, write_back=True),
    )
    for p in prefixes:
        llm.generate([*p, 0], GREEDY)
    outputs = [llm.generate([*p, 1], GREEDY) for p in prefixes]
    assert llm.stats().cache.write_backs > 0
    assert sum(o.num_cached_tokens_in(Tier.HOST) for o in outputs) > 0
    for p, output in zip(prefixes, outputs):
        assert output.num_cached_tokens == 96
        assert output.token_ids == cold.generate([*p, 1], GREEDY).token_ids
    assert_host_copies_match(llm)
    llm.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_hybrid_outputs_match_cold_runs_through_eviction_and_reload(device):
    rng = random.Random(3)
    base = [rng.randrange(256) for _ in range(240)]
    prompts = [
        base[: rng.randrange(90, 240)] + [rng.randrange(256) for _ in range(5)] for _ in range(8)
    ]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cold = LLM("tiny-hybrid", device=device, scheduler_config=COLD)
    reference = [o.token_ids for o in cold.generate(prompts, params)]
    llm = LLM(
        "tiny-hybrid",
        device=device,
        num_npu_blocks=40,
        scheduler_config=offload(
            host_memory_ratio=4.0, write_through_threshold="immediate", max_num_batched_tokens=96
        ),
    )
    outputs = [llm.generate(p, params) for p in prompts]
    assert [o.token_ids for o in outputs] == reference
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert llm.stats().cache.npu_evictions > 0  # 40 blocks hold fewer than the 8 prompts
    llm.reset_prefix_cache("npu")
    reloaded = [llm.generate(p, params) for p in prompts]
    assert [o.token_ids for o in reloaded] == reference
    first = reloaded[0]
    assert first.num_cached_tokens_in(Tier.HOST) == first.num_cached_tokens > 0
    per_type = llm.stats().cache.by_cache_type
    assert per_type["full"].blocks_loaded > 0 and per_type["sliding"].blocks_loaded > 0
    assert_host_copies_match(llm)
    llm.check_integrity()


SYSTEM = (
    "You are a careful assistant for a library. You answer questions about books, authors and "
    "reading in two sentences at most. You are polite, precise and you never invent titles. "
    "When you do not know, you say so plainly and suggest where the reader could look."
)
QUESTIONS = [
    "Who wrote Pride and Prejudice?",
    "What is a good first novel for a ten-year-old reader?",
    "How should I care for an old paperback?",
]


def default_model_or_skip() -> str:
    from replicas.model import load_model_info

    name = "smollm2-135m"
    try:
        load_model_info(name)
    except Exception as error:  # not installed here (e.g. no network to fetch its package)
        pytest.skip(f"model {name} is not available: {error}")
    return name


@pytest.mark.parametrize("device", SLOW_ON_CPU)
def test_smollm2_host_reload_gives_the_cold_outputs(device):
    model = default_model_or_skip()
    greedy = SamplingParams(max_tokens=16, temperature=0)
    cold = LLM(model, device=device, scheduler_config=COLD)
    prompts = [
        cold.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in QUESTIONS
    ]
    reference = [cold.generate(p, greedy).token_ids for p in prompts]
    cold.shutdown()
    llm = LLM(
        model,
        device=device,
        num_npu_blocks=48,
        scheduler_config=offload(host_memory_ratio=4.0, write_through_threshold="immediate"),
    )
    first = llm.generate(prompts[0], greedy)
    assert first.num_cached_tokens == 0 and first.token_ids == reference[0]
    npu_hit = llm.generate(prompts[1], greedy)  # the system prompt is on the NPU tier
    assert npu_hit.num_cached_tokens_in(Tier.NPU) > 0 and npu_hit.token_ids == reference[1]
    llm.reset_prefix_cache("npu")  # evict every cached NPU block: the host copies remain
    host_hit = llm.generate(prompts[2], greedy)
    assert host_hit.num_cached_tokens_in(Tier.HOST) > 0
    assert host_hit.num_cached_tokens_in(Tier.NPU) == 0
    assert host_hit.token_ids == reference[2]
    again = [llm.generate(p, greedy) for p in prompts]
    assert [o.token_ids for o in again] == reference
    assert all(o.num_cached_tokens > 0 for o in again)
    assert_host_copies_match(llm)
    llm.check_integrity()
    llm.shutdown()
