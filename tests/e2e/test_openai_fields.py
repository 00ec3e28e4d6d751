"""Every optional OpenAI field Strata serves, through the official ``openai`` client against
the default real model (SmolLM2-135M-Instruct) on 127.0.0.1: n, best_of, logprobs, echo,
penalties, prompt lists, stream_options and structured outputs."""

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from cluster.api.cache_breakpoints import breakpoint_tokens
from replicas.engine.engine import Engine
from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path
from tests.e2e.test_http_local import Server, default_model_server
from tests.unit.sampling.conftest import reference_scores

try:
    packaged_model_path(DEFAULT_MODEL)
except FileNotFoundError as error:  # pragma: no cover - the test install provides it
    pytest.skip(str(error), allow_module_level=True)

GREEDY = {"temperature": 0}
PROMPT = "The history of the printing press begins"


class _Model:
    """What ``reference_scores`` reads of an ``LLM``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with default_model_server() as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(server: Server) -> str:
    return server.engine.loaded.name


def test_n_choices_and_prompt_lists(client, model_name, server):
    answer = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, n=3, **GREEDY)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.text for c in answer.choices}) == 1  # greedy: identical choices
    num_prompt = len(server.engine.tokenizer.encode(PROMPT))
    assert answer.usage.prompt_tokens == num_prompt  # the choices share one prompt
    assert answer.usage.completion_tokens == 18
    sampled = dict(model=model_name, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=11)
    first = client.completions.create(**sampled)
    assert len({c.text for c in first.choices}) > 1
    assert [c.text for c in client.completions.create(**sampled).choices] == [
        c.text for c in first.choices
    ]
    batched = client.completions.create(
        model=model_name, prompt=[PROMPT, "def fibonacci(n):"], max_tokens=4, n=2, **GREEDY
    )
    alone = client.completions.create(
        model=model_name, prompt="def fibonacci(n):", max_tokens=4, **GREEDY
    )
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    assert batched.choices[2].text == batched.choices[3].text == alone.choices[0].text
    best = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, n=2, best_of=4, temperature=1.0, seed=3
    )
    assert len(best.choices) == 2 and best.choices[0].logprobs is None


def test_echo_logprobs_equal_the_models_log_softmax(client, model_name, server):
    answer = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=1, logprobs=2, echo=True, **GREEDY
    )
    choice = answer.choices[0]
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    engine = server.engine
    tokens = engine.tokenizer.encode(PROMPT)
    num_prompt = len(tokens)
    assert len(logprobs.tokens) == num_prompt + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    generated = engine.tokenizer.encode(PROMPT + choice.text[len(PROMPT) :])[num_prompt:]
    ref = reference_scores(_Model(engine), tokens + generated[:1])
    for position in range(1, num_prompt + 1):
        token = (tokens + generated)[position]
        assert logprobs.token_logprobs[position] == pytest.approx(
            ref[position - 1, token].item(), abs=2e-2
        )
        assert len(logprobs.top_logprobs[position]) >= 2
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_logprobs_of_a_cached_prefix_are_not_recomputed(client, model_name, server):
    prompt = f"{PROMPT} in the fifteenth century, when" * 6
    body = dict(model=model_name, max_tokens=1, logprobs=1, echo=True, **GREEDY)
    cold = client.completions.create(prompt=prompt, **body)
    filled = server.engine.core.prompt_scores.num_filled_tokens
    warm = client.completions.create(prompt=f"{prompt} a different ending", **body)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= 48  # whole blocks of the shared prompt
    assert server.engine.core.prompt_scores.num_filled_tokens - filled == cached
    num_shared = cached + 1  # scores of the cached tokens (the first has none)
    assert warm.choices[0].logprobs.token_logprobs[1:num_shared] == pytest.approx(
        cold.choices[0].logprobs.token_logprobs[1:num_shared], abs=2e-2
    )


def test_chat_logprobs_streaming_and_not(client, model_name):
    messages = [{"role": "user", "content": "Name a colour."}]
    answer = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert "".join(t.token for t in content) == answer.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-4  # greedy: the top token
        assert bytes(entry.bytes).decode() == entry.token
    stream = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in
                c.choices[0].logprobs.content]  # fmt: skip
    assert [t.token for t in streamed] == [t.token for t in content]
    assert chunks[-1].usage.completion_tokens == 5


def test_penalties_change_a_repetitive_output(client, model_name):
    prompt = "List the numbers: one one one one one one"
    plain = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, **GREEDY)
    penalized = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=12,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        **GREEDY,
    )
    assert plain.choices[0].text != penalized.choices[0].text
    words = penalized.choices[0].text.split()
    assert words.count("one") < plain.choices[0].text.split().count("one") or not words


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
}


def test_structured_outputs_parse_and_validate(client, model_name):
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    answer = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        **GREEDY,
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    answer = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=60,
        response_format={"type": "json_object"},
        **GREEDY,
    )
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    regex = client.completions.create(
        model=model_name,
        prompt="A date: ",
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
        **GREEDY,
    )
    assert len(regex.choices[0].text) == 10 and regex.choices[0].text[4] == "-"
    choice = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
        **GREEDY,
    )
    assert choice.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}},
                }
            },
            "response_format",
        ),
    ],
)
def test_bad_values_are_400_naming_the_field(client, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kwargs
        )
    assert raised.value.body["param"] == param


def test_streamed_choices_and_usage(client, model_name):
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=[PROMPT, "def fibonacci(n):"],
            max_tokens=5,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=1,
            **GREEDY,
        )
    )
    texts: dict[int, str] = {}
    num_scored: dict[int, int] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        num_scored[choice.index] = num_scored.get(choice.index, 0) + len(choice.logprobs.tokens)
    assert sorted(texts) == [0, 1, 2, 3] and texts[0] == texts[1] and texts[2] == texts[3]
    assert num_scored == {0: 5, 1: 5, 2: 5, 3: 5}
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 20
    whole = client.completions.create(
        model=model_name, prompt=[PROMPT, "def fibonacci(n):"], max_tokens=5, n=2, **GREEDY
    )
    assert [c.text for c in whole.choices] == [texts[i] for i in range(4)]
    assert whole.usage.prompt_tokens == usage.prompt_tokens


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client, model_name):
    body = dict(model=model_name, prompt=PROMPT, echo=True, logprobs=1, **GREEDY)
    scored = client.completions.create(max_tokens=0, **body)
    with_token = client.completions.create(max_tokens=1, **body)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    num_prompt = scored.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt
    assert choice.logprobs.token_logprobs == pytest.approx(
        with_token.choices[0].logprobs.token_logprobs[:num_prompt], abs=2e-2
    )
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0)
    assert raised.value.body["param"] == "max_tokens"


def test_prompt_cache_fields_through_the_official_client(client, model_name, server):
    system = "You answer questions about the history of printing. " * 3
    answer = client.chat.completions.create(
        model=model_name,
        messages=[
            {
                "role": "system",
                "content": [
                    {
                        "type": "text",
                        "text": system,
                        "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
                    }
                ],
            },
            {"role": "user", "content": "Who printed first?"},
        ],
        prompt_cache_key="printing-session",
        prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        prompt_cache_retention="24h",
        max_tokens=4,
        **GREEDY,
    )
    assert answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=2,
            extra_body={"prompt_cache_options": {"ttl": "3d"}},
        )
    assert error.value.body["param"] == "prompt_cache_options"


def test_a_breakpoint_position_under_the_real_chat_template(server):
    tokenizer = server.engine.tokenizer
    system = "You answer questions about the history of printing. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who?"}]
    token_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    ((position, ttl),) = breakpoint_tokens(
        tokenizer.apply_chat_template,
        tokenizer.encode,
        messages,
        [(0, len(system), 60.0)],
        token_ids,
    )
    text = tokenizer.apply_chat_template(messages)
    before = text[: text.index(system) + len(system)]
    assert position == len(tokenizer.encode(before)) and ttl == 60.0
    assert token_ids[:position] == tokenizer.encode(before)  # a prefix of the prompt's tokens
    assert 0 < position < len(token_ids)
