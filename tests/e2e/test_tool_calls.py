"""Tool calling through the official ``openai`` client against the default real model
(SmolLM2-135M-Instruct, greedy) on 127.0.0.1: required and named calls parse and follow their
schemas, auto answers or calls, streamed calls reassemble to the answered ones (also through the
client's own stream helper), a call cut by max_tokens leaks no markup, a tool conversation reuses
its first turn's cached prompt, and bad tools are 400s."""

import json
import typing
from collections.abc import Iterator

import jsonschema
import openai
import pydantic
import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path
from tests.e2e.test_http_local import Server

try:
    packaged_model_path(DEFAULT_MODEL)
except FileNotFoundError as error:  # pragma: no cover - the test install provides it
    pytest.skip(str(error), allow_module_level=True)

GREEDY = {"temperature": 0, "max_tokens": 96}
BLOCK_SIZE = 16
NAME = {"type": "string", "maxLength": 24}


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS = [
    function(
        "get_weather",
        "Current weather of a city.",
        {"city": NAME, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    function(
        "add", "Adds two numbers.", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]
    ),
    function(
        "set_alarm",
        "Sets an alarm.",
        {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "minute": {"type": "integer", "minimum": 0, "maximum": 59},
            "repeat": {"type": "boolean"},
        },
        ["hour", "minute"],
    ),
    function(
        "create_event",
        "Creates a calendar event.",
        {
            "title": NAME,
            "attendees": {"type": "array", "items": NAME, "maxItems": 2},
            "place": {
                "type": "object",
                "properties": {"city": NAME, "room": {"type": "integer"}},
                "required": ["city"],
            },
        },
        ["title", "place"],
    ),
    function(
        "search",
        "Searches the web.",
        {
            "query": NAME,
            "limit": {"type": "integer", "minimum": 1, "maximum": 10},
            "filters": {
                "type": "object",
                "properties": {"lang": {"enum": ["en", "fr"]}, "safe": {"type": "boolean"}},
                "required": ["lang", "safe"],
            },
        },
        ["query", "filters"],
    ),
    function(
        "convert_currency",
        "Converts an amount of money.",
        {
            "amount": {"type": "number", "minimum": 0},
            "source": {"enum": ["USD", "EUR", "JPY"]},
            "target": {"enum": ["USD", "EUR", "JPY"]},
        },
        ["amount", "source", "target"],
    ),
    function(
        "send_email",
        "Sends an email.",
        {"to": NAME, "subject": NAME, "cc": {"type": "array", "items": NAME, "maxItems": 1}},
        ["to", "subject"],
    ),
    function(
        "book_flight",
        "Books a flight.",
        {
            "passenger": {
                "type": "object",
                "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0}},
                "required": ["name", "age"],
            },
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "seat": {"enum": ["window", "aisle"]},
        },
        ["passenger", "date"],
    ),
    function(
        "toggle_light",
        "Turns a light on or off.",
        {"room": {"enum": ["kitchen", "bedroom"]}, "on": {"type": "boolean"}},
        ["room", "on"],
    ),
    function(
        "rate_movie",
        "Rates a movie.",
        {
            "title": NAME,
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "tags": {"type": "array", "items": {"enum": ["funny", "sad", "long"]}, "maxItems": 2},
        },
        ["title", "stars"],
    ),
]  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """The default real model as ``default_model_server`` serves it, with room for ten tools
    in the prompt (about 1,300 tokens)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    config = EngineConfig(
        model=DEFAULT_MODEL, dtype="float32", num_npu_blocks=512, max_model_len=2048
    )
    try:
        with Server(Engine(config)) as running:
            yield running
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(server: Server) -> str:
    return server.engine.loaded.name


def check_calls(message, finish_reason: str) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each checked against its function's schema."""
    assert finish_reason == "tool_calls"
    assert message.tool_calls, message
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_named_calls_follow_each_schema(client, model_name):
    for name in SCHEMAS:
        answer = client.chat.completions.create(
            model=model_name,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            parallel_tool_calls=False,
            **GREEDY,
        )
        choice = answer.choices[0]
        assert [n for n, _ in check_calls(choice.message, choice.finish_reason)] == [name]
        assert choice.message.content is None


def test_required_calls_parse_and_validate(client, model_name):
    for content in ("Add 2 and 3.", "Wake me up at 7:30.", "Turn the kitchen light on."):
        answer = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": content}],
            tools=TOOLS,
            tool_choice="required",
            **GREEDY,
        )
        choice = answer.choices[0]
        assert check_calls(choice.message, choice.finish_reason)


def test_auto_answers_or_calls_well_formed(client, model_name):
    for content in ("Hello! Who are you?", "What is the weather like in Paris today?"):
        answer = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": content}],
            tools=TOOLS[:3],
            **GREEDY,
        )
        choice = answer.choices[0]
        if choice.message.tool_calls:
            check_calls(choice.message, choice.finish_reason)
        else:
            assert choice.finish_reason in ("stop", "length")
            assert choice.message.content and "<tool_call>" not in choice.message.content


def test_streamed_calls_reassemble_to_the_answered_ones(client, model_name):
    body = dict(model=model_name, messages=ASK, tools=TOOLS, parallel_tool_calls=False, **GREEDY)
    for tool_choice in ("required", {"type": "function", "function": {"name": "book_flight"}}):
        whole = client.chat.completions.create(tool_choice=tool_choice, **body).choices[0]
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        names: dict[int, str] = {}
        ids: dict[int, str] = {}
        arguments: dict[int, str] = {}
        content, finish_reason = "", None
        for chunk in client.chat.completions.create(tool_choice=tool_choice, stream=True, **body):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            finish_reason = chunk.choices[0].finish_reason or finish_reason
            for call in delta.tool_calls or []:
                if call.id is not None:  # a call's first delta
                    assert call.index not in ids and call.type == "function"
                    ids[call.index], names[call.index] = call.id, call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or ""
                )
        assert content == "" and finish_reason == whole.finish_reason == "tool_calls"
        assert [(names[i], arguments[i]) for i in sorted(names)] == expected
        assert len(set(ids.values())) == len(ids)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    unit: typing.Literal["celsius", "fahrenheit"] | None = None


def test_the_clients_stream_helper_parses_streamed_calls(client, model_name):
    """openai's own ``chat.completions.stream`` helper: it accumulates every entry of a chunk
    and parses the finished arguments into the tool's pydantic model. Each chunk holds one
    entry per call index, the header with the arguments' first fragment (OpenAI's shape)."""
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    deltas, headers = [], []
    with client.chat.completions.stream(
        model=model_name,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    ) as stream:
        for event in stream:
            if event.type == "chunk":
                entries = (
                    event.chunk.choices[0].delta.tool_calls or [] if event.chunk.choices else []
                )
                assert len({e.index for e in entries}) == len(entries)
                headers += [e for e in entries if e.id is not None]
            elif event.type == "tool_calls.function.arguments.delta":
                deltas.append(event.arguments_delta)
        final = stream.get_final_completion()
    [header] = headers
    assert header.function.name == "get_weather" and header.function.arguments.startswith("{")
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert "".join(deltas) == call.function.arguments
    assert isinstance(call.function.parsed_arguments, Weather)


def test_a_call_cut_by_max_tokens_never_leaks_markup(client, model_name):
    """Calls allowed in parallel and required: the model calls until max_tokens cuts it. The
    answer and the stream keep the calls begun (the last as far as written), never markup in
    ``content``, and say ``length``."""
    body = dict(model=model_name, messages=ASK, tools=TOOLS[:1], tool_choice="required")
    for max_tokens in (23, 41, 50):  # in arguments, in the next tag, before its name
        answer = client.chat.completions.create(temperature=0, max_tokens=max_tokens, **body)
        choice = answer.choices[0]
        assert choice.finish_reason == "length", choice
        assert choice.message.content is None, choice.message.content
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert all(name == "get_weather" for name, _ in calls)
        for _, arguments in calls[:-1]:  # every call before the last is whole
            jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])
        content, streamed, finish_reason = "", {}, None
        chunks = client.chat.completions.create(
            temperature=0, max_tokens=max_tokens, stream=True, **body
        )
        for chunk in chunks:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            finish_reason = chunk.choices[0].finish_reason or finish_reason
            for call in delta.tool_calls or []:
                name, arguments = streamed.get(call.index, ("", ""))
                name = call.function.name or name
                streamed[call.index] = (name, arguments + (call.function.arguments or ""))
        assert content == "" and finish_reason == "length"
        assert [streamed[i] for i in sorted(streamed)] == calls


def test_a_tool_conversation_reuses_the_first_turns_prompt(client, model_name, server):
    tools = TOOLS[:4]
    first = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        **GREEDY,
    )
    message = first.choices[0].message
    assert [n for n, _ in check_calls(message, first.choices[0].finish_reason)] == ["get_weather"]
    history = [
        *ASK,
        message.model_dump(include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny, 21 C."},
    ]
    second = client.chat.completions.create(
        model=model_name, messages=history, tools=tools, temperature=0, max_tokens=24
    )
    num_first = first.usage.prompt_tokens
    assert second.usage.prompt_tokens > num_first + 20
    # The first turn's prompt is a prefix of the second's: all its full blocks are cached (the
    # last token may merge with the reply's first, so one block is spared).
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (num_first - 1) // BLOCK_SIZE * BLOCK_SIZE
    reply = second.choices[0]
    if reply.message.tool_calls:
        check_calls(reply.message, reply.finish_reason)
    else:
        assert reply.message.content and "<tool_call>" not in reply.message.content


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integr"}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS[:2] + TOOLS[:1]}, "tools[2].function.name"),
        ({"tools": TOOLS[:2], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS[:1], "tool_choice": "required",  # the call wins; the format is checked
          "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
         "response_format"),
    ],
)  # fmt: skip
def test_bad_tools_are_400_naming_the_field(client, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_name, messages=ASK, max_tokens=2, **kwargs)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param
