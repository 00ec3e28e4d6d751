"""The replica engine end to end on the built-in model, against cache-off references."""

import asyncio
import random

import pytest

from cluster import LLM, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.engine.engine import sum_stats
from replicas.kv.events import Tier

BS = 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(256) for _ in range(160)]
    return [
        base[: rng.randrange(20, 160)] + [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
        for _ in range(n)
    ]


def no_cache() -> SchedulerConfig:
    return SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def assert_clean(llm: LLM) -> None:
    llm.check_integrity()
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert llm.engine.kv_cache.npu.num_used == 0


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts(16)


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    llm = LLM("tiny", scheduler_config=no_cache())
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_prefix_cache_on_matches_cache_off(prompts, reference):
    llm = LLM("tiny")
    outputs = [llm.generate(p, GREEDY) for p in prompts]
    assert [o.token_ids for o in outputs] == reference
    # Expected reuse: the longest full-block match against any earlier request's tokens
    # (prompt and output), always leaving the last prompt token to compute.
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        best = max(
            (common_prefix_len(prompt, prompts[j] + reference[j]) for j in range(i)), default=0
        )
        expected = min(best // BS, (len(prompt) - 1) // BS) * BS
        assert output.num_cached_tokens == expected, i
        assert output.num_cached_tokens_by_tier == (expected, 0, 0)
    assert sum(o.num_cached_tokens for o in outputs) > 0
    stats = llm.stats().cache
    assert stats.queries == sum(len(p) for p in prompts)
    assert stats.hits == sum(o.num_cached_tokens for o in outputs)
    assert_clean(llm)


def test_preemption_under_a_tiny_pool_keeps_outputs(prompts, reference):
    llm = LLM(
        "tiny", num_npu_blocks=24, scheduler_config=SchedulerConfig(max_num_batched_tokens=64)
    )
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    assert llm.stats().num_preemptions > 0
    assert_clean(llm)


def test_chunked_prefill_matches_one_shot(prompts, reference):
    llm = LLM("tiny", scheduler_config=SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=3))
    outputs = llm.generate(prompts[:4], GREEDY)
    assert [o.token_ids for o in outputs] == reference[:4]
    assert_clean(llm)


def test_eviction_order_on_a_tiny_pool():
    llm = LLM("tiny", num_npu_blocks=8, max_model_len=64)
    one = SamplingParams(max_tokens=1)
    a = [7] * 49  # 4 blocks, the first 3 full and cached, the 4th holding one computed token
    llm.generate(a, one)  # the partial block kept: allocated after empty blocks, before cached
    b = [9] * 49
    llm.generate(b, one)  # takes the 4 empty blocks; its partial block kept after a's
    c = [11] * 33  # 3 blocks: the kept ones (a's, then b's), then a's deepest cached block
    llm.generate(c, one)
    assert llm.engine.kv_cache.npu.num_cached == 2 + 3 + 2  # a keeps 2, b 3, c cached 2
    assert llm.generate([*b, 1], one).num_cached_tokens == 48  # b's partial block went to c
    assert llm.generate([*a, 1], one).num_cached_tokens == 32
    assert_clean(llm)


@pytest.mark.parametrize("budget", [2048, 64])  # the prefix in one step, or in two
def test_requests_of_one_new_prefix_arriving_together_compute_it_once(budget):
    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(6 * BS)]
    prompts = [prefix + [rng.randrange(256) for _ in range(5)] for _ in range(3)]
    reference = LLM("tiny", scheduler_config=no_cache()).generate(prompts, GREEDY)
    llm = LLM("tiny", scheduler_config=SchedulerConfig(max_num_batched_tokens=budget))
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    # the first computes the prefix; the others wait for its blocks instead of computing them
    assert [o.num_cached_tokens for o in outputs] == [0, 6 * BS, 6 * BS]
    assert_clean(llm)


def test_cache_salt_isolates_prefixes():
    llm = LLM("tiny")
    prompt = list(range(100))
    llm.generate(prompt, GREEDY, cache_salt="tenant-a")
    assert llm.generate(prompt, GREEDY, cache_salt="tenant-b").num_cached_tokens == 0
    # 96 from whole blocks, 3 from the partial block the first run ended in (its 100th token is
    # computed again: the last prompt token always is)
    assert llm.generate(prompt, GREEDY, cache_salt="tenant-a").num_cached_tokens == 99


def test_single_and_batched_prompts_and_text():
    llm = LLM("tiny")
    one = llm.generate("hello strata", GREEDY)
    many = llm.generate(["hello strata", [1, 2, 3]], GREEDY)
    assert isinstance(many, list) and len(many) == 2
    assert many[0].token_ids == one.token_ids
    assert one.prompt == "hello strata" and one.prompt_token_ids[0] == 256  # BOS
    assert one.finish_reason == "length" and len(one.token_ids) == 12
    assert one.ttft_s is not None and one.ttft_s >= 0
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])


def test_streamed_pieces_add_up_to_the_text():
    llm = LLM("tiny")
    llm.engine.add_request("s", "stream me", SamplingParams(max_tokens=20, ignore_eos=True))
    pieces, tokens, final = [], [], None
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            pieces.append(output.new_text)
            tokens.extend(output.new_token_ids)
            final = output
    assert "".join(pieces) == final.text
    assert tokens == final.token_ids


def test_abort_frees_every_block():
    llm = LLM("tiny")
    llm.engine.add_request("x", list(range(200)), SamplingParams(max_tokens=50))
    llm.engine.step()
    assert llm.engine.kv_cache.npu.num_used > 0
    output = llm.engine.abort_request("x")
    assert output.finished and output.finish_reason == "abort"
    assert_clean(llm)
    assert llm.engine.abort_request("x") is None


@pytest.mark.parametrize(
    ("kwargs", "prompt", "message"),
    [
        ({"max_model_len": 64}, list(range(64)), "max_model_len"),
        ({}, [], "empty"),
        ({}, [1, 999], "vocabulary"),
    ],
)
def test_bad_prompts_are_rejected(kwargs, prompt, message):
    llm = LLM("tiny", **kwargs)
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY)
    assert_clean(llm)


def test_a_checked_prompt_is_queued_without_a_second_check():
    engine = LLM("tiny", max_model_len=64).engine
    checked = engine.check_prompt(list(range(63)))
    with pytest.raises(ValueError, match="max_model_len is 64"):
        engine.check_prompt(list(range(64)))
    engine.checks.max_model_len = 0  # any check of it now fails: add_request does not make one
    request = engine.add_request("r", checked, SamplingParams(max_tokens=1))
    engine.checks.max_model_len = 64
    assert request.prompt_token_ids == list(range(63))
    engine.abort_request("r")
    with pytest.warns(DeprecationWarning, match="check_prompt"):
        assert engine.validate_prompt([1, 2]) == [1, 2]


def test_max_model_len_larger_than_the_pool_is_a_startup_error():
    with pytest.raises(ValueError, match="max_model_len=256 exceeds the NPU KV pool"):
        LLM("tiny", num_npu_blocks=4, max_model_len=256)


def test_default_max_model_len_fits_the_pool():
    llm = LLM("tiny", num_npu_blocks=4)
    assert llm.engine.max_model_len == 64
    output = llm.generate(list(range(60)), SamplingParams(max_tokens=50, ignore_eos=True))
    assert output.finish_reason == "length" and len(output.token_ids) == 4


def test_max_tokens_and_stop_conditions():
    llm = LLM("tiny")
    prompt = "stop conditions"
    full = llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    # stop token id: ends right after that token
    token = full.token_ids[5]
    first = full.token_ids.index(token)
    stopped = llm.generate(prompt, SamplingParams(max_tokens=16, stop_token_ids=[token]))
    assert stopped.token_ids == full.token_ids[: first + 1] and stopped.finish_reason == "stop"
    # stop string: text ends before it
    stop = next(ch for ch in full.text[3:] if ch.isprintable() and ch != "\ufffd")
    cut = full.text.index(stop)
    by_string = llm.generate(prompt, SamplingParams(max_tokens=16, stop=[stop], ignore_eos=True))
    assert by_string.text == full.text[:cut] and by_string.finish_reason == "stop"


def test_eos_ends_generation_unless_ignored():
    llm = LLM("tiny")
    prompt = "eos"
    first = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True)).token_ids[0]
    llm.engine.core.eos_token_ids = frozenset({first})
    assert llm.generate(prompt, SamplingParams(max_tokens=8)).token_ids == [first]
    ignored = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(ignored.token_ids) == 8


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    llm = LLM("tiny")
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = llm.generate("sample", params)
    batched = llm.generate(["other", "sample", "more"], [GREEDY, params, GREEDY])[1]
    assert alone.token_ids == batched.token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=8)
    assert llm.generate("sample", other_seed).token_ids != alone.token_ids
    top1 = SamplingParams(max_tokens=16, temperature=1.0, top_k=1, ignore_eos=True, seed=3)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    assert llm.generate("sample", top1).token_ids == llm.generate("sample", greedy).token_ids


def test_llm_works_from_inside_a_running_event_loop():
    # As in a notebook: the calling thread already runs an event loop.
    llm = LLM("tiny")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = llm.generate("loop", params).token_ids

    async def call() -> list[int]:
        return llm.generate("loop", params).token_ids

    assert asyncio.run(call()) == expected
    llm.shutdown()
    assert llm.engine is None


def test_summed_stats_add_every_counter_and_usage_per_cache_type():
    hybrid = LLM("tiny-hybrid", num_npu_blocks=32)
    plain = LLM("tiny", num_npu_blocks=16)
    for llm in (hybrid, plain):
        llm.generate(list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    a, b = hybrid.stats(), plain.stats()
    total = sum_stats([a, b])
    assert total.cache.queries == a.cache.queries + b.cache.queries > 0
    assert total.num_preemptions == a.num_preemptions + b.num_preemptions
    assert total.cache_types["full"].of(Tier.NPU).num_blocks == 32 + 16
    assert total.cache_types["sliding"] == a.cache_types["sliding"]  # only one has it
    assert sum_stats([a]) == a
