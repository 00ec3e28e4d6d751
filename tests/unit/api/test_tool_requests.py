"""Tool calling through the HTTP app over the tiny engine: 400s naming the bad field, and calls
that the grammar forces whatever the (random) model prefers."""

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.api.protocol import ChatCompletionRequest
from cluster.api.tools import plan_tools
from cluster.backend import LocalBackend
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.engine.structured_output import GrammarCompiler
from replicas.model.tokenizer import ByteTokenizer
from tests.unit.api.conftest import assert_engine_clean

PING = {"type": "function", "function": {"name": "ping", "description": "Checks the line."}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 3}},
            "required": ["city"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "Is the line up?"}]
FORCED = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine() -> Engine:
    """Room for the tools block, which the byte tokenizer spends a token per byte on."""
    return Engine(EngineConfig(model="tiny", num_npu_blocks=256, max_model_len=2048))


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(LocalBackend(engine), max_tokens_limit=64)) as test_client:
        yield test_client
    assert_engine_clean(engine)


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})


def bad(function: dict) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tools": [bad({"name": "f", "parameters": {"properties": {"a": {"type": "strin"}}}})]},
         "tools[0].function.parameters", "not a valid JSON schema"),
        ({"tools": [bad({"name": "f", "parameters": {"type": "object", "uniqueItems": True}})]},
         "tools[0].function.parameters", "not a valid JSON schema"),
        ({"tools": [bad({"name": "f", "parameters": {"type": "array"}})]},
         "tools[0].function.parameters", "object"),
        ({"tools": [PING, WEATHER, PING]}, "tools[2].function.name", "names two tools"),
        ({"tools": []}, "tools", "at least one tool"),
        ({"tools": [bad({"name": "has space"})]}, "tools[0].function.name", "letters"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "custom"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "needs a function"),
        ({"tools": [PING], "tool_choice": {"type": "function", "function": {"name": "pong"}}},
         "tool_choice", "'pong', which is not among the tools (ping)"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice",
         "no tools"),
        ({"tools": [PING], "tool_choice": "sometimes"}, "tool_choice", "one of none, auto"),
        ({"tools": [PING], "tool_choice": "required",
          "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
         "response_format", "json"),  # a forced call wins, but a bad format is still a 400
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages", "assistant"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(client, body, param, words):
    answer = chat(client, max_tokens=1, **body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "constraint",
    [{"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}}],
)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_a_forced_call_wins_over_an_output_constraint(client, choice, constraint):
    """As OpenAI serves the pair: the output is the call; the constraint is for text."""
    body = {"tools": [PING], "tool_choice": choice, "parallel_tool_calls": False, **constraint}
    answer = chat(client, max_tokens=60, temperature=0, **body)
    assert answer.status_code == 200, answer.text
    choice_ = answer.json()["choices"][0]
    assert choice_["finish_reason"] == "tool_calls" and choice_["message"]["content"] is None
    assert [c["function"] for c in choice_["message"]["tool_calls"]] == [
        {"name": "ping", "arguments": "{}"}
    ]


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_none_and_auto_without_tools_are_served(client, choice):
    answer = chat(client, max_tokens=2, tool_choice=choice)
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_a_required_call_is_forced_and_parsed(client, engine, choice):
    body = {"tools": [WEATHER, PING], "tool_choice": choice, "parallel_tool_calls": False}
    if choice == "required":
        body["tools"] = [PING]
    answer = chat(client, max_tokens=60, temperature=0, logprobs=True, **body)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    choice_ = data["choices"][0]
    assert choice_["finish_reason"] == "tool_calls"
    assert choice_["message"]["content"] is None
    [call] = choice_["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "ping", "arguments": "{}"}
    # Usage and logprobs count every generated token, markup included.
    assert data["usage"]["completion_tokens"] == len(FORCED) + 1  # bytes, then EOS
    assert len(choice_["logprobs"]["content"]) == data["usage"]["completion_tokens"]
    assert_engine_clean(engine)


def test_a_streamed_call_reassembles_to_the_answered_one(client, engine):
    body = {"tools": [PING], "tool_choice": "required", "parallel_tool_calls": False}
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "stream": True, **body},
    ) as answer:
        assert answer.status_code == 200
        events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["index"] == 0 and deltas[0]["type"] == "function"
    # The header and the arguments' first fragment in one entry, one entry per chunk.
    assert deltas[0]["function"] == {"name": "ping", "arguments": "{"}
    assert "".join(d["function"].get("arguments", "") for d in deltas) == "{}"
    assert all(len(c["choices"][0]["delta"].get("tool_calls", [])) <= 1 for c in chunks)
    assert all(c["choices"][0]["delta"].get("content") in (None, "") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert_engine_clean(engine)


def test_a_tool_conversation_renders_and_is_answered(client):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rom"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    answer = client.post(
        "/v1/chat/completions",
        json={"messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3},
    )
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert "tool_calls" not in data["choices"][0]["message"]
    prompt = client.app.state.backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is the line up?"}]
    )
    # The tools block, the call written as text and the result make the prompt longer.
    assert data["usage"]["prompt_tokens"] > len(prompt) + 300


@pytest.mark.parametrize(
    ("choice", "parses"), [("none", False), ("auto", True), ("required", True)]
)
def test_every_tool_choice_constrains_the_output_and_none_parses_no_calls(choice, parses):
    compiler = GrammarCompiler(ByteTokenizer(), ByteTokenizer().vocab_size)
    body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [PING, WEATHER], "tool_choice": choice}
    )
    plan = plan_tools(body, lambda: compiler)
    assert plan.parses_calls is parses
    matcher = compiler.matcher(plan.constraint)
    # The call's tag is never allowed under none, always reachable under the others.
    for token in b"Sure. ":
        if choice == "required":
            break
        matcher.accept(token)
    allowed = True
    try:
        for token in b"<tool_call>":
            matcher.accept(token)
    except ValueError:
        allowed = False
    assert allowed is (choice != "none")
