"""``/v1/responses`` with function tools: calls and their outputs across turns, a forced
function with a text format (OpenAI makes the call), ``max_tool_calls``."""

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    Usage,
)
from cluster.api.renderers import ChatRenderer
from cluster.api.responses.protocol import ResponseObject
from cluster.api.responses.renderer import ResponsesRenderer
from cluster.backend import LocalBackend
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.model.tokenizer import ByteTokenizer
from replicas.outputs import RequestOutput
from tests.unit.api.conftest import assert_engine_clean
from tests.unit.api.test_responses import TOOLS, events_of


@pytest.fixture(scope="module")
def long_client() -> Iterator[TestClient]:
    """Room for the tools block, which the byte tokenizer spells one token per byte."""
    engine = Engine(EngineConfig(model="tiny", num_npu_blocks=256, max_model_len=2048))
    with TestClient(create_app(LocalBackend(engine), max_tokens_limit=64)) as test_client:
        yield test_client
    assert_engine_clean(engine)


def test_a_function_call_then_its_output(long_client):
    body = {
        "input": "weather?",
        "tools": TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 64,
        "temperature": 0,
    }
    answer = long_client.post("/v1/responses", json=body).json()
    calls = [item for item in answer["output"] if item["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {}
    assert calls[0]["call_id"] and calls[0]["id"].startswith("fc_")
    assert answer["tools"] == TOOLS
    streamed = events_of(long_client, {**body, "stream": True})
    names = [name for name, _ in streamed]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in names
    done = [data for name, data in streamed if name == "response.function_call_arguments.done"]
    assert [(d["name"], d["arguments"]) for d in done] == [("get_weather", "{}")]
    final = streamed[-1][1]["response"]
    assert [item["call_id"] for item in final["output"]] == [
        data["item"]["call_id"] for name, data in streamed if name == "response.output_item.done"
    ]
    result = {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "sunny"}
    follow = {
        "input": [result],
        "tools": TOOLS,
        "previous_response_id": answer["id"],
        "max_output_tokens": 2,
        "temperature": 0,
    }
    second = long_client.post("/v1/responses", json=follow).json()
    assert second["status"] in ("completed", "incomplete"), second
    num_first = answer["usage"]["input_tokens"] + answer["usage"]["output_tokens"]
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == num_first - 1  # every computed token of the first answer


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_with_a_text_format_is_called(long_client, stream):
    """instructor's RESPONSES_TOOLS sends a named tool_choice with text.format: OpenAI makes
    the call, the format being for text output, of which there is none."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    body = {  # a short name: the call fits in 64 byte tokens
        "input": "weather?",
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": schema}},
        "max_output_tokens": 64,
        "temperature": 0,
    }
    if stream:
        answer = events_of(long_client, {**body, "stream": True})[-1][1]["response"]
    else:
        response = long_client.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
    assert answer["status"] == "completed"
    assert [(i["type"], i["name"], i["arguments"]) for i in answer["output"]] == [
        ("function_call", "f", "{}")
    ]
    assert answer["text"]["format"]["type"] == "json_schema"


class TwoCalls(ChatRenderer):
    """A chat renderer whose answer is some text and then two calls (the tiny model's
    constrained calls come one at a time)."""

    def chunk(self, index: int, output: RequestOutput) -> ChatCompletionChunk:
        calls = [
            DeltaToolCall(
                index=i, id=f"c{i}", type="function", function=DeltaFunction(name=f"f{i}")
            )
            for i in range(2)
        ] + [DeltaToolCall(index=i, function=DeltaFunction(arguments="{}")) for i in range(2)]
        delta = DeltaMessage(content="hi", tool_calls=calls)
        return ChatCompletionChunk(
            id="x", created=0, model="m", choices=[ChatStreamChoice(delta=delta)]
        )

    def response(self, choices, usage: Usage) -> ChatCompletionResponse:
        calls = [
            ToolCall(id=f"c{i}", function={"name": f"f{i}", "arguments": "{}"}) for i in (0, 1)
        ]
        message = AssistantMessage(content="hi", tool_calls=calls)
        return ChatCompletionResponse(
            id="x", created=0, model="m", choices=[ChatChoice(message=message)]
        )


def finished_output() -> RequestOutput:
    return RequestOutput(
        "r", [1, 2], [3], "hi", [3], "hi", True, "stop", 0, (0, 0, 0), 0.0, 0.0, 0.0
    )


@pytest.mark.parametrize("limit, names", [(None, ["f0", "f1"]), (1, ["f0"])])
def test_max_tool_calls_keeps_the_first_calls(limit, names):
    def renderer() -> ResponsesRenderer:
        draft = ResponseObject(id="resp_1", created_at=0, model="m", max_tool_calls=limit)
        return ResponsesRenderer(TwoCalls("m", ByteTokenizer()), draft)

    def kinds(output: list) -> list:
        return [(item.type, getattr(item, "name", None)) for item in output]

    answer = renderer().response([(0, finished_output())], Usage())
    assert kinds(answer.output) == [("message", None)] + [("function_call", n) for n in names]
    streaming = renderer()
    frames = b"".join(
        streaming.encode(batch)
        for batch in [
            *streaming.first_chunks(),
            streaming.chunk(0, finished_output()),
            streaming.usage_chunk(Usage()),
        ]
    )
    events = [json.loads(block.split(b"data: ")[1]) for block in frames.strip().split(b"\n\n")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    closing = ["response.function_call_arguments.done", "response.output_item.done"]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",  # the text is done when the first call starts
        "response.content_part.done",
        "response.output_item.done",
        *["response.output_item.added"] * len(names),
        *["response.function_call_arguments.delta"] * len(names),
        *closing * len(names),
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [item.get("name") for item in final["output"]] == [None, *names]
    assert [e["output_index"] for e in events if e["type"].endswith("arguments.done")] == [
        1 + i for i in range(len(names))
    ]
