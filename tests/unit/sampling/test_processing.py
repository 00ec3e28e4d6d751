"""Logits processing by hand-computed cases, and n / best_of choices through ``LLM``."""

import pytest
import torch

from cluster import LLM, SamplingParams
from replicas.engine.request import Request
from replicas.engine.sampler import Sampler
from tests.unit.sampling.conftest import reference_logits

EOS = 0


def processed_row(logits: list[float], prompt: list[int], output: list[int], **params) -> list:
    """The row the sampler picks from (its greedy argmax is over this row)."""
    sampler = Sampler(0, torch.device("cpu"), eos_token_ids=(EOS,))
    request = Request("r", prompt, SamplingParams(max_tokens=8, **params), 16)
    for token in output:
        request.append_output_token(token)
    rows = torch.tensor([logits])
    sampler.processor.process(rows, [request], {})
    return rows[0].tolist()


def test_frequency_and_presence_penalties_count_output_tokens_only():
    row = processed_row(
        [2.0, -1.0, 0.5, 3.0, 1.0],
        prompt=[4, 4],
        output=[3, 3, 1],
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # token 3 twice: 3 - 2 * 0.5 - 0.25; token 1 once: -1 - 0.5 - 0.25; token 4 only in prompt
    assert row == pytest.approx([2.0, -1.75, 0.5, 1.75, 1.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    row = processed_row([2.0, -1.0, 0.5, 3.0, 1.0], prompt=[1], output=[3], repetition_penalty=2.0)
    assert row == pytest.approx([2.0, -2.0, 0.5, 1.5, 1.0])


def test_logit_bias_and_min_tokens():
    row = processed_row([2.0, -1.0, 0.5], prompt=[1], output=[2], logit_bias={1: 10.0})
    assert row == pytest.approx([2.0, 9.0, 0.5])
    row = processed_row([2.0, -1.0, 0.5], prompt=[1], output=[2], min_tokens=2, stop_token_ids=[2])
    assert row[0] == row[2] == float("-inf") and row[1] == -1.0
    row = processed_row([2.0, -1.0, 0.5], prompt=[1], output=[2, 2], min_tokens=2)
    assert row == [2.0, -1.0, 0.5]  # two tokens are out: EOS is allowed again


def test_greedy_sampling_follows_the_processed_row():
    llm = LLM("tiny")
    prompt = list(range(20))
    plain = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    biased = llm.generate(
        prompt, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={7: 100.0})
    )
    assert plain.token_ids != [7] * 6 and biased.token_ids == [7] * 6


@pytest.mark.parametrize(
    "penalties",
    [
        {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"repetition_penalty": 1.8},
        {"presence_penalty": -2.0},
    ],
)
def test_penalized_greedy_decode_equals_a_replay_over_the_models_scores(penalties):
    """Each step's token is the argmax of the model's logits with the penalties applied by
    hand (the reference scores one whole sequence in one pass)."""
    llm = LLM("tiny")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    output = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, **penalties))
    plain = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert output.token_ids != plain.token_ids  # the penalties matter here
    tokens = prompt + output.token_ids
    logits = reference_logits(llm, tokens)
    for i, token in enumerate(output.token_ids):
        row = logits[len(prompt) - 1 + i].clone()
        before = output.token_ids[:i]
        seen = set(prompt) | set(before)
        if "repetition_penalty" in penalties:
            p = penalties["repetition_penalty"]
            for t in seen:
                row[t] = row[t] / p if row[t] > 0 else row[t] * p
        for t in set(before):
            row[t] -= penalties.get("frequency_penalty", 0) * before.count(t)
            row[t] -= penalties.get("presence_penalty", 0)
        assert token == int(row.argmax())


def test_n_choices_share_the_prompt_and_follow_their_seeds():
    llm = LLM("tiny")
    prompt = list(range(40))  # 2 full blocks and 8 tokens
    greedy = llm.generate(prompt, SamplingParams(n=4, max_tokens=6, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in greedy}) == 1
    assert [o.index for o in greedy] == [0, 1, 2, 3]
    computed = llm.engine.core.num_scheduled_tokens
    sampled = SamplingParams(n=4, max_tokens=6, ignore_eos=True, temperature=8.0, seed=7)
    first = llm.generate(list(range(100, 140)), sampled)
    # The prompt is computed once, then each other choice computes its last partial block.
    prompt_work = llm.engine.core.num_scheduled_tokens - computed - 4 * 5
    assert prompt_work == 40 + 3 * 8
    assert len({tuple(o.token_ids) for o in first}) == 4
    again = llm.generate(list(range(100, 140)), sampled)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    alone = llm.generate(list(range(100, 140)), SamplingParams(**{**_fields(sampled), "n": 1}))
    assert alone.token_ids == first[0].token_ids


def test_best_of_returns_the_likeliest_sequences():
    llm = LLM("tiny")
    params = SamplingParams(n=2, best_of=5, max_tokens=5, ignore_eos=True, temperature=8.0)
    choices = llm.generate(list(range(30)), SamplingParams(**{**_fields(params), "seed": 3}))
    assert len(choices) == 2 and choices[0].logprobs is None
    every = llm.generate(
        list(range(30)),
        SamplingParams(**{**_fields(params), "seed": 3, "n": 5, "best_of": None, "logprobs": 0}),
    )
    ranked = sorted(every, key=lambda o: o.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in choices] == [o.token_ids for o in ranked[:2]]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_min_p_keeps_tokens_within_its_share_of_the_likeliest():
    """Probabilities 0.5, 0.25, 0.125, 0.125 (temperature 1): of 64 seeded draws each lands on
    a token min_p keeps (at least min_p x 0.5), and every kept token is drawn."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = probs.log()[None].repeat(64, 1)
    for min_p, expected in ((0.2, {0, 1, 2, 3}), (0.3, {0, 1}), (0.6, {0}), (1.0, {0})):
        sampler = Sampler(0, torch.device("cpu"))
        requests = [
            Request(f"r{i}", [1], SamplingParams(temperature=1.0, min_p=min_p, seed=i), 16)
            for i in range(64)
        ]
        assert set(sampler.sample(logits.clone(), requests).token_ids) == expected, min_p
