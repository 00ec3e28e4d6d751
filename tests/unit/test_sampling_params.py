import pytest

from cluster import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    params = SamplingParams(stop="END")
    assert params.stop == ["END"]
    assert params.is_greedy and params.max_tokens == 16
    assert not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(temperature=1e-40).is_greedy


def test_extreme_values_sample_without_breaking_the_engine():
    from cluster import LLM

    llm = LLM("tiny")
    greedy = llm.generate("x", SamplingParams(max_tokens=4, ignore_eos=True))
    for params in (
        SamplingParams(max_tokens=4, temperature=1e-40, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=1.0, top_p=1e-45, seed=2**63, ignore_eos=True),
    ):
        assert llm.generate("x", params).token_ids == greedy.token_ids
