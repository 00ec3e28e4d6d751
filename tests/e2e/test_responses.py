"""``/v1/responses`` through the official ``openai`` client against the default real model
(SmolLM2-135M-Instruct) on 127.0.0.1: string and list input, instructions, streaming, the
json_schema text format, a conversation continued by ``previous_response_id`` (reusing the
whole previous turn's KV), retrieve and delete, and a function call answered by its output."""

import json
from collections.abc import Iterator

import openai
import pytest

from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path
from tests.e2e.test_http_local import Server, default_model_server

try:
    packaged_model_path(DEFAULT_MODEL)
except FileNotFoundError as error:  # pragma: no cover - the test install provides it
    pytest.skip(str(error), allow_module_level=True)

GREEDY = {"temperature": 0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


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


def block_floor(num_tokens: int, server: Server) -> int:
    block_size = server.engine.config.block_size
    return num_tokens // block_size * block_size


def test_string_and_list_input_with_instructions(client, model_name, server):
    answer = client.responses.create(
        model=model_name, input="What is the capital of France?", max_output_tokens=24, **GREEDY
    )
    assert answer.object == "response" and answer.status in ("completed", "incomplete")
    assert answer.output_text.strip()
    assert answer.usage.input_tokens > 0 and 0 < answer.usage.output_tokens <= 24
    listed = client.responses.create(
        model=model_name,
        instructions="You answer in one short sentence.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        ],
        max_output_tokens=24,
        **GREEDY,
    )
    assert listed.instructions == "You answer in one short sentence."
    assert listed.output[0].type == "message" and listed.output_text.strip()
    tokenizer = server.engine.tokenizer
    conversation = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a colour."},
    ]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(conversation))
    assert listed.usage.input_tokens == len(prompt)
    assert client.responses.retrieve(listed.id).output_text == listed.output_text
    client.responses.delete(listed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(listed.id)


def test_a_stream_reassembles_to_the_answer(client, model_name):
    request = dict(model=model_name, input="Say hello.", max_output_tokens=32, **GREEDY)
    answer = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        if answer.status == "completed":
            final = stream.get_final_response()
            assert final.output_text == answer.output_text
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] == f"response.{answer.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == answer.output_text
    raw = client.responses.create(**request, stream=True)
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == (
        answer.output_text
    )


def test_json_schema_text_format(client, model_name):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    answer = client.responses.create(
        model=model_name,
        input="Describe a person as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        max_output_tokens=48,
        **GREEDY,
    )
    assert answer.status == "completed", answer
    person = json.loads(answer.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_a_conversation_continues_by_id_and_reuses_the_first_turn(client, model_name, server):
    first = client.responses.create(
        model=model_name,
        instructions="You are a helpful assistant.",
        input="Tell me a fact about the moon.",
        max_output_tokens=40,
        **GREEDY,
    )
    second = client.responses.create(
        model=model_name,
        instructions="You are a helpful assistant.",
        input="And one about the sun.",
        previous_response_id=first.id,
        max_output_tokens=8,
        **GREEDY,
    )
    assert second.previous_response_id == first.id
    num_first = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > num_first
    # Every full block of turn 1, prompt and output (but its last token, never computed).
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= block_floor(num_first - 1, server)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=model_name, input="x", previous_response_id="resp_unknown", max_output_tokens=1
        )


def test_a_function_call_then_its_output(client, model_name, server):
    call_turn = client.responses.create(
        model=model_name,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=48,
        **GREEDY,
    )
    calls = [item for item in call_turn.output if item.type == "function_call"]
    assert calls, call_turn.output
    assert calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments), dict)
    answer = client.responses.create(
        model=model_name,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24C"}
        ],
        tools=[WEATHER],
        previous_response_id=call_turn.id,
        max_output_tokens=24,
        **GREEDY,
    )
    assert answer.output and answer.usage.output_tokens > 0
    num_first = call_turn.usage.input_tokens + call_turn.usage.output_tokens
    cached = answer.usage.input_tokens_details.cached_tokens
    assert cached >= block_floor(num_first - 1, server)
