"""Resuming a request in the engine (``replicas.resume``), no Ray: an engine given the output
tokens a lost replica sent, and the characters of their text the client received, continues
exactly as the uninterrupted run would (greedy), with the held-back text, stop strings across
the cut, logprobs, penalties, min_tokens and a grammar all counting the earlier output."""

import json

import pytest

from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.engine.structured_output import StructuredOutputs
from replicas.resume import ResumeState, resumed_params
from replicas.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model="tiny", num_npu_blocks=256, max_model_len=512))


def run(engine: Engine, request_id: str, params: SamplingParams, resumed=None) -> list:
    """Every output of one request, alone on the engine."""
    engine.add_request(request_id, PROMPT, params, resumed=resumed)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def cut(outputs: list, num_tokens: int) -> tuple[ResumeState, str]:
    """What a client holds after the output that brought ``num_tokens`` tokens: the state to
    resume from, and the text it received."""
    output = next(o for o in outputs if len(o.token_ids) == num_tokens)
    text = "".join(o.new_text for o in outputs[: outputs.index(output) + 1])
    assert output.text == text
    return ResumeState.of(output), text


def resumed_run(engine, request_id, params, outputs, num_tokens):
    """The uninterrupted ``outputs`` cut after ``num_tokens`` and resumed: (tokens, text, new
    outputs) as the client sees them."""
    state, text = cut(outputs, num_tokens)
    more = run(engine, request_id, params, state)
    tokens = list(state.output_token_ids) + [t for o in more for t in o.new_token_ids]
    assert more[-1].token_ids == tokens  # the engine's cumulative tokens include the earlier
    return tokens, text + "".join(o.new_text for o in more), more


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3),
        SamplingParams(
            max_tokens=40, repetition_penalty=1.4, frequency_penalty=0.8, presence_penalty=0.5
        ),
        SamplingParams(max_tokens=40, min_tokens=30, logit_bias={258 - 3: 5.0}),
    ],
    ids=["greedy", "logprobs", "penalties", "min_tokens"],
)
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 33])
def test_a_resumed_greedy_request_continues_exactly(engine, params, num_tokens):
    reference = run(engine, "whole", params)
    final = reference[-1]
    if len(final.token_ids) <= num_tokens:
        pytest.skip("the uninterrupted run ended before the cut")
    tokens, text, more = resumed_run(engine, "resumed", params, reference, num_tokens)
    assert tokens == final.token_ids
    assert text == final.text
    assert more[-1].finish_reason == final.finish_reason
    if params.logprobs is not None:
        got, want = more[-1].logprobs, final.logprobs
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
        assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
        assert [o.new_logprobs for o in more] == [o.logprobs[-1:] for o in more]
    engine.check_integrity()


def test_penalties_count_the_earlier_output_as_output(engine):
    """Frequency and presence penalties apply to output tokens only: had the earlier output
    become prompt, the resumed run would differ from the uninterrupted one."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=2.0)
    reference = run(engine, "whole", params)[-1]
    plain = run(engine, "plain", SamplingParams(max_tokens=40, ignore_eos=True))[-1]
    assert reference.token_ids != plain.token_ids  # the penalty shapes this output
    as_prompt = SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=2.0)
    engine.add_request("glued", PROMPT + reference.token_ids[:10], as_prompt)
    while engine.has_unfinished_requests():
        glued = [o for o in engine.step() if o.request_id == "glued"]
    assert reference.token_ids[:10] + glued[-1].token_ids != reference.token_ids
    tokens, _, _ = resumed_run(engine, "resumed", params, run(engine, "w", params), 10)
    assert tokens == reference.token_ids


def test_a_stop_string_across_the_cut_still_stops(engine):
    """The client received the text up to the hold-back; the stop string begins in the text
    held back when the replica was lost and ends in tokens the survivor generates."""
    plain = SamplingParams(max_tokens=60, ignore_eos=True)
    whole = run(engine, "plain", plain)[-1]
    decode = engine.tokenizer.decode
    found = 0
    for k in range(4, 50):  # a cut whose neighbourhood is plain ASCII (one char per token)
        window = whole.token_ids[k - 2 : k + 2]
        stop = decode(window)
        if all(32 <= t < 127 for t in window) and decode(whole.token_ids[:k]).endswith(stop[:2]):
            start = whole.text.find(stop)
            if start == len(decode(whole.token_ids[: k - 2])):  # its first occurrence
                found += 1
                params = SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop, "\x00\x01"])
                reference = run(engine, "stopped", params)
                assert reference[-1].text == whole.text[:start]
                _, received = cut(reference, k)
                assert len(received) < start + 2  # the straddling part was held back
                tokens, text, more = resumed_run(engine, "resumed", params, reference, k)
                assert (tokens, text) == (reference[-1].token_ids, reference[-1].text)
                assert more[-1].finish_reason == "stop"
    if not found:
        pytest.skip("no ASCII stretch in this model's output to cut at")


def test_a_grammar_continues_from_the_earlier_output(engine):
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=60, structured_outputs=spec)
    reference = run(engine, "whole", params)
    final = reference[-1]
    json.loads(final.text)  # complete JSON
    for num_tokens in (1, 3, len(final.token_ids) // 2):
        tokens, text, _ = resumed_run(
            engine, f"resumed-{num_tokens}", params, reference, num_tokens
        )
        assert (tokens, text) == (final.token_ids, final.text)


def test_a_resumed_request_counts_the_earlier_tokens_against_max_tokens(engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reference = run(engine, "whole", params)
    tokens, _, more = resumed_run(engine, "resumed", params, reference, 5)
    assert len(tokens) == 12 and len(more) == 7 and more[-1].finish_reason == "length"
    assert more[-1].prompt_token_ids == PROMPT  # the prompt stays the prompt


def test_a_complete_or_inconsistent_resume_is_refused(engine):
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1)
    with pytest.raises(ValueError, match="complete"):
        engine.add_request("x", PROMPT, params, resumed=ResumeState((1, 2, 3), 3, None))
    with pytest.raises(ValueError, match="logprob"):
        engine.add_request("y", PROMPT, params, resumed=ResumeState((1,), 1, None))
    assert not engine.has_unfinished_requests()


def test_resumed_params_derive_a_seed_per_resume():
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=7, prompt_logprobs=2)
    first, again, second = (resumed_params(params, n) for n in (1, 1, 2))
    assert first.seed == again.seed and len({params.seed, first.seed, second.seed}) == 3
    assert first.prompt_logprobs is None and first.max_tokens == 8
    assert resumed_params(SamplingParams(temperature=0.8), 1).seed is None


def test_a_seeded_resume_is_reproducible(engine):
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=3)
    reference = run(engine, "whole", params)
    state, _ = cut(reference, 10)
    again = resumed_params(params, 1)
    one = run(engine, "a", again, state)[-1]
    two = run(engine, "b", again, state)[-1]
    assert one.token_ids == two.token_ids and one.token_ids[:10] == reference[-1].token_ids[:10]
