"""Logprobs against the model's own log-softmax over the whole sequence in one pass (no block
cache reuse, no batching), for prompt and output tokens, with and without a cached prefix."""

import random

import pytest

from cluster import LLM, KVOffloadConfig, SamplingParams, SchedulerConfig
from replicas.kv.events import Tier
from tests.unit.sampling.conftest import reference_scores

TOL = 2e-3  # float32 over a different batch shape
BS = 16


def check_against_reference(llm: LLM, output, num_top: int) -> None:
    tokens = output.prompt_token_ids + output.token_ids
    ref = reference_scores(llm, tokens)
    scored = [*output.prompt_logprobs[1:], *output.logprobs]
    assert output.prompt_logprobs[0] is None
    assert len(scored) == len(tokens) - 1
    for position, score in enumerate(scored, start=1):
        row = ref[position - 1]
        assert score.token_id == tokens[position]
        assert score.logprob == pytest.approx(row[tokens[position]].item(), abs=TOL)
        assert len(score.top) == num_top
        values, ids = row.topk(num_top)
        assert [v for _, v in score.top] == pytest.approx(values.tolist(), abs=TOL)
        assert score.top[0][0] == ids[0].item()
    assert output.cumulative_logprob == pytest.approx(
        sum(s.logprob for s in output.logprobs), abs=1e-4
    )


def params(**kwargs) -> SamplingParams:
    kwargs = {"logprobs": 3, "prompt_logprobs": 3, **kwargs}
    return SamplingParams(max_tokens=6, ignore_eos=True, **kwargs)


def test_logprobs_cold_and_with_a_cached_prefix_on_npu():
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(70)]
    llm = LLM("tiny")
    cold = llm.generate([*prefix, 1, 2], params())
    assert cold.num_cached_tokens == 0
    check_against_reference(llm, cold, 3)
    warm = llm.generate([*prefix, 3, 4, 5], params())
    assert warm.num_cached_tokens_in(Tier.NPU) == 64  # 4 shared blocks, scores from the cache
    assert llm.engine.core.prompt_scores.num_filled_tokens == 64
    check_against_reference(llm, warm, 3)
    # A prefix computed without scoring cannot serve a scored prompt: it is recomputed once.
    other = [rng.randrange(256) for _ in range(50)]
    llm.generate([*other, 1], SamplingParams(max_tokens=2))
    unscored = llm.generate([*other, 2], params())
    assert unscored.num_cached_tokens == 0
    check_against_reference(llm, unscored, 3)
    again = llm.generate([*other, 3], params(temperature=1.0, seed=3))
    assert again.num_cached_tokens == 48
    check_against_reference(llm, again, 3)
    llm.check_integrity()


def test_logprobs_with_a_cached_prefix_on_host():
    rng = random.Random(1)
    prefix = [rng.randrange(256) for _ in range(200)]
    llm = LLM(
        "tiny",
        num_npu_blocks=40,
        scheduler_config=SchedulerConfig(
            kv_offload_config=KVOffloadConfig(
                enabled=True, host_memory_ratio=2.0, write_through_threshold=1
            )
        ),
    )
    llm.generate([*prefix, 9], params())
    llm.generate([*prefix, 8], params())  # a hit: promoted to host
    for i in range(5):  # unrelated traffic pushes the prefix out of the NPU tier
        llm.generate([rng.randrange(256) for _ in range(180)] + [i], SamplingParams(max_tokens=2))
    output = llm.generate([*prefix, 1, 2, 3], params(logprobs=5, prompt_logprobs=1))
    assert output.num_cached_tokens_by_tier == (0, 192, 0)
    tokens = output.prompt_token_ids + output.token_ids
    ref = reference_scores(llm, tokens)
    for position, score in enumerate([*output.prompt_logprobs[1:], *output.logprobs], start=1):
        assert score.logprob == pytest.approx(ref[position - 1, tokens[position]].item(), abs=TOL)
    assert [len(s.top) for s in output.prompt_logprobs[1:]] == [1] * (len(prefix) + 2)
    assert [len(s.top) for s in output.logprobs] == [5] * 6
    llm.check_integrity()


def test_generated_logprobs_are_the_models_not_the_processed_distribution():
    """Penalties and temperature change what is sampled, not the reported logprobs."""
    llm = LLM("tiny")
    prompt = list(range(30))
    output = llm.generate(
        prompt,
        SamplingParams(
            max_tokens=8,
            ignore_eos=True,
            logprobs=2,
            temperature=0.7,
            seed=1,
            repetition_penalty=1.5,
            logit_bias={5: 4.0},
        ),
    )
    ref = reference_scores(llm, prompt + output.token_ids)
    for i, score in enumerate(output.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert score.logprob == pytest.approx(row[output.token_ids[i]].item(), abs=TOL)
