"""The real default model (SmolLM2-135M-Instruct) through the prefix cache and the host tier:
greedy outputs equal cold runs with caching off, on NPU hits and after NPU eviction and reload."""

import pytest

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.kv.events import Tier
from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path

try:
    packaged_model_path(DEFAULT_MODEL)
except ValueError as missing:
    pytest.skip(str(missing), allow_module_level=True)

GREEDY = SamplingParams(max_tokens=16, temperature=0)
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
QUOTE = (
    "Repeat this sentence exactly: The old lighthouse keeper climbed the spiral stairs every "
    "evening, trimmed the wick and wrote the weather in his leather logbook."
)
# The weights' dtype is pinned to float32, the reference these outputs are compared in; how the
# linear weights are kept stays auto (measured on the machine). A run and its reference decode the
# same requests in the same batches: torch's packed int4 product is not batch-invariant.
DTYPE = "float32"
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# About 200 tokens each, distinct from their first token: 13 blocks apiece, 78 in all.
FILLERS = [f"Note {n}. " + "The quick brown fox jumps over the lazy dog. " * 20 for n in range(6)]


def chats(llm: LLM, questions: list[str]) -> list[str]:
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in questions
    ]


@pytest.fixture(scope="module")
def cold_outputs():
    cold = LLM(
        DEFAULT_MODEL,
        dtype=DTYPE,
        scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
    )
    try:
        yield {p: cold.generate(p, GREEDY).token_ids for p in chats(cold, QUESTIONS)}
    finally:
        cold.shutdown()


def test_cached_and_host_reloaded_prefixes_give_the_cold_outputs(cold_outputs):
    llm = LLM(
        DEFAULT_MODEL,
        dtype=DTYPE,
        num_npu_blocks=24,
        scheduler_config=SchedulerConfig(
            kv_offload_config=KVOffloadConfig(
                enabled=True, host_memory_ratio=4.0, write_through_threshold=1
            )
        ),
    )
    prompts = chats(llm, QUESTIONS)
    first = llm.generate(prompts[0], GREEDY)
    assert first.num_cached_tokens == 0 and first.token_ids == cold_outputs[prompts[0]]
    npu_hit = llm.generate(prompts[1], GREEDY)  # the system prompt is on the NPU tier
    assert npu_hit.num_cached_tokens_in(Tier.NPU) > 0
    assert npu_hit.num_cached_tokens_in(Tier.HOST) == 0
    assert npu_hit.token_ids == cold_outputs[prompts[1]]
    for filler in FILLERS:  # unrelated traffic pushes the system prompt out of the NPU tier
        llm.generate(filler, SamplingParams(max_tokens=1))
    host_hit = llm.generate(prompts[2], GREEDY)
    assert host_hit.num_cached_tokens_in(Tier.HOST) > 0, host_hit
    assert host_hit.token_ids == cold_outputs[prompts[2]]
    again = llm.generate(prompts[0], GREEDY)
    assert again.num_cached_tokens > 0 and again.token_ids == cold_outputs[prompts[0]]
    llm.check_integrity()
    llm.shutdown()


def test_chat_renders_the_template_and_answers(cold_outputs):
    with LLM(DEFAULT_MODEL, dtype=DTYPE) as llm:
        conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ""}]
        conversation[1]["content"] = QUESTIONS[0]
        single = llm.chat(conversation, GREEDY)
        assert single.token_ids == cold_outputs[chats(llm, QUESTIONS[:1])[0]]
        both = llm.chat(
            [conversation, [{"role": "user", "content": "What is the capital of France?"}]],
            SamplingParams(max_tokens=12, temperature=0),
        )
        assert both[0].token_ids == single.token_ids[:12]
        assert "Paris" in both[1].text, both[1].text
        with pytest.raises(ValueError, match="role"):
            llm.chat([{"content": "no role"}])


def test_speculative_decoding_gives_the_outputs_without_it():
    """Draft tokens verified in the forward pass change no token, and a quote accepts them.
    The packed int4 products compute each row alone, so the draft rows add no rounding to the
    linear layers, and each draft token attends alone, so it pads no other row; each prompt
    runs alone (batching decodes together changes the attention's rounding, drafts or not).
    The story is 128 tokens of free text that left plain decoding's tokens at token 44 while
    draft rows were padded into the group of the request's own decode."""
    weights = {"dtype": "float32", "quantization": "int4"}
    off = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))
    with LLM(DEFAULT_MODEL, scheduler_config=off, **weights) as cold:
        prompts = chats(cold, [*QUESTIONS, QUOTE])
        expected = [cold.generate(p, GREEDY).token_ids for p in prompts]
        story = cold.tokenizer.apply_chat_template([{"role": "user", "content": STORY}])
        long = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        expected_story = cold.generate(story, long).token_ids
    spec = SchedulerConfig(speculative_ngram=4)
    with LLM(DEFAULT_MODEL, scheduler_config=spec, **weights) as llm:
        accepted = []
        for prompt, tokens in zip(prompts, expected, strict=True):
            before = llm.stats().spec_decode.num_accepted_tokens
            assert llm.generate(prompt, GREEDY).token_ids == tokens
            accepted.append(llm.stats().spec_decode.num_accepted_tokens - before)
        assert accepted[-1] >= 8, accepted  # the quote
        assert llm.generate(story, long).token_ids == expected_story
        llm.check_integrity()
