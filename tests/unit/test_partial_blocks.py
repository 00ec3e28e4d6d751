"""Reuse of a freed request's partly computed last block (``replicas.kv.partial_blocks``): a
prompt that extends a finished one computes only what is new, with the outputs of an engine
that caches nothing; a block reallocated since, another cache salt, a reset, a hybrid model or
prompt logprobs give no reuse."""

import pytest

from cluster import LLM, SamplingParams
from replicas.config import PrefixCacheConfig, SchedulerConfig
from replicas.engine.request import Request
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import BlockCopy
from tests.unit.test_engine import assert_clean

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(
        "tiny",
        scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
    )


def tokens(n: int, start: int = 0) -> list[int]:
    return [(start + 7 * i) % 250 + 1 for i in range(n)]


def test_a_prompt_extending_a_finished_one_computes_only_what_is_new(reference):
    llm = LLM("tiny")
    prefix = tokens(44)  # two whole blocks and 12 tokens of a third
    assert llm.generate(prefix, FIRST).num_cached_tokens == 0
    extended = prefix + tokens(6, start=3)
    out = llm.generate(extended, GREEDY)
    assert out.num_cached_tokens == 44  # 32 from whole blocks, 12 from the partial one
    assert list(out.token_ids) == list(reference.generate(extended, GREEDY).token_ids)
    assert_clean(llm)


def test_the_next_turn_of_a_chat_reuses_the_block_its_answer_ended_in(reference):
    llm = LLM("tiny")
    prompt = tokens(40)
    answer = list(llm.generate(prompt, GREEDY).token_ids)  # 40 + 7 tokens computed
    turn = prompt + answer + tokens(5, start=9)
    out = llm.generate(turn, GREEDY)
    assert out.num_cached_tokens == 47
    assert list(out.token_ids) == list(reference.generate(turn, GREEDY).token_ids)
    assert_clean(llm)


def test_a_prompt_diverging_inside_the_partial_block_reuses_the_common_tokens(reference):
    llm = LLM("tiny")
    prefix = tokens(44)
    llm.generate(prefix, FIRST)
    other = prefix[:37] + tokens(10, start=100)  # the same first 5 tokens of the third block
    out = llm.generate(other, GREEDY)
    assert out.num_cached_tokens == 37
    assert list(out.token_ids) == list(reference.generate(other, GREEDY).token_ids)


def test_different_chunks_after_one_prefix_each_reuse_its_partial_block(reference):
    llm = LLM("tiny")
    prefix = tokens(44)
    llm.generate(prefix, FIRST)
    for start in (3, 11):  # one after another: the source block is copied, not consumed
        chunk = prefix + tokens(12, start=start)
        out = llm.generate(chunk, GREEDY)
        assert out.num_cached_tokens == 44
        assert list(out.token_ids) == list(reference.generate(chunk, GREEDY).token_ids)
    chunks = [prefix + tokens(12, start=s) for s in (20, 31, 42)]  # admitted in one step
    outs = llm.generate(chunks, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [44, 44, 44]
    expected = reference.generate(chunks, GREEDY)
    assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in expected]
    assert_clean(llm)


def test_no_reuse_once_the_block_was_allocated_again(reference):
    llm = LLM("tiny", num_npu_blocks=8)
    prefix = tokens(44)
    llm.generate(prefix, FIRST)  # 2 cached blocks, the partial one kept
    llm.generate(tokens(90, start=50), FIRST)  # 6 blocks: the 5 empty ones, then the partial
    extended = prefix + tokens(6, start=3)
    out = llm.generate(extended, GREEDY)
    assert out.num_cached_tokens == 32  # whole blocks only
    assert list(out.token_ids) == list(reference.generate(extended, GREEDY).token_ids)


def test_a_partial_block_outlives_empty_blocks_but_not_its_replacement():
    llm = LLM("tiny", num_npu_blocks=8)
    pool = llm.engine.kv_cache.npu
    prefix = tokens(44)
    llm.generate(prefix, FIRST)
    assert pool.num_kept == 1
    llm.generate(tokens(20, start=50), FIRST)  # 2 blocks: empty ones, not the kept one
    assert llm.generate(prefix + [5], FIRST).num_cached_tokens == 44
    # prefix + [5] left its own partial block (13 tokens) under the same prefix; the one it
    # replaced is an empty block again
    assert pool.num_kept == 2  # the 20-token prompt's partial block and prefix + [5]'s
    assert llm.generate(prefix + [5, 6], FIRST).num_cached_tokens == 45
    assert_clean(llm)


def test_kept_blocks_never_cost_a_cached_block_its_place():
    llm = LLM("tiny", num_npu_blocks=8)
    pool = llm.engine.kv_cache.npu
    first = tokens(40)  # 2 cached blocks, 1 kept
    llm.generate(first, FIRST)
    second = tokens(40, start=100)  # 2 cached, 1 kept: 3 empty blocks left
    llm.generate(second, FIRST)
    assert (pool.num_cached, pool.num_kept) == (4, 2)
    llm.generate(tokens(80, start=200), FIRST)  # 5 blocks: 2 empty, both kept, then first's
    assert pool.num_kept == 0  # both taken; its own 80 tokens fill 5 blocks, none partial
    assert pool.num_cached == 3 + 5  # one cached block evicted (first's deepest), not three
    assert llm.generate(second + [1], FIRST).num_cached_tokens == 32  # its whole blocks stayed


def test_no_reuse_across_cache_salts_or_after_a_reset():
    llm = LLM("tiny")
    short = tokens(10)  # no whole block: only a partial one could be reused
    llm.generate(short, FIRST, cache_salt="tenant-a")
    assert llm.generate(short + [5, 6], FIRST, cache_salt="tenant-b").num_cached_tokens == 0
    llm.generate(short, FIRST, cache_salt="tenant-a")
    assert llm.generate(short + [5, 6], FIRST, cache_salt="tenant-a").num_cached_tokens == 10
    llm.generate(short, FIRST)
    llm.reset_prefix_cache("npu")
    assert llm.generate(short + [5, 6], FIRST).num_cached_tokens == 0


def test_hybrid_models_and_prompt_logprobs_reuse_whole_blocks_only():
    hybrid = LLM("tiny-hybrid")
    prefix = tokens(44)
    hybrid.generate(prefix, FIRST)
    assert hybrid.generate(prefix + [5, 6], FIRST).num_cached_tokens % 16 == 0
    llm = LLM("tiny")
    llm.generate(prefix, FIRST)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1)
    assert llm.generate(prefix + [5, 6], scored).num_cached_tokens % 16 == 0


def test_a_source_is_held_until_the_plan_with_its_copy_is_taken():
    """Manager level, no tensors: nothing allocated in the step that plans a copy gets its
    source; once the plan is taken the source is free again, last in line, and still valid."""
    bs = 4
    manager = KVCacheManager(4, bs, reuse_partial_blocks=True)
    first = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(), bs)  # 1 whole block + 2 tokens
    assert manager.allocate_slots(first, 6)
    first.num_computed_tokens = 6
    manager.cache_blocks(first)
    source = manager.block_ids("a")[1]
    manager.free(first)
    manager.take_transfer_plan()
    pool = manager.npu
    assert pool.eviction_order()[-2:] == [source, 0]  # kept: before any cached block

    second = Request("b", [1, 2, 3, 4, 5, 6, 7], SamplingParams(), bs)
    match = manager.match_prefix(second)
    assert (match.num_blocks, match.num_tail_tokens) == (1, 2)
    assert manager.allocate_slots(second, 7 - 6, match)  # its own block for the tail
    manager.record_admission(second, match)
    assert second.num_cached_tokens == 6
    third = Request("c", [9] * 4, SamplingParams(), bs)
    assert manager.allocate_slots(third, 4)  # the last empty block
    fourth = Request("d", [8] * 4, SamplingParams(), bs)
    assert not manager.allocate_slots(fourth, 4)  # only the source is unreferenced: held
    manager.check_integrity()
    plan = manager.take_transfer_plan()
    assert plan.block_copies == (BlockCopy(source, manager.block_ids("b")[1]),)
    assert pool.eviction_order() == [source]  # released: the only free block
    manager.check_integrity()
    fifth = Request("e", [1, 2, 3, 4, 5, 6, 8], SamplingParams(), bs)
    assert manager.match_prefix(fifth).num_tail_tokens == 2  # the source still serves
