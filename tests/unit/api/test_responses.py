"""``/v1/responses``: input translation, answers and streams in OpenAI's shapes, the store
(per API key, ``previous_response_id`` reusing the previous turn's KV), and the 400s/404s."""

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.api.errors import APIError
from cluster.api.responses.protocol import ResponsesRequest
from cluster.api.responses.store import ResponseStoreConfig, StoredResponse
from cluster.api.responses.translate import chat_body, continuation_ids, input_messages
from cluster.backend import ReplicaFailedError
from replicas.model.tokenizer import ByteTokenizer
from tests.unit.api.conftest import ScriptedBackend
from tests.unit.api.test_errors import assert_error

GREEDY = {"temperature": 0, "ignore_eos": True}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {}},
    }
]


def prompt_len(messages: list[dict]) -> int:
    tokenizer = ByteTokenizer()
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages)))


def events_of(client: TestClient, body: dict, headers: dict | None = None) -> list[tuple]:
    """(event name, data) of each server-sent event of a streamed request."""
    with client.stream("POST", "/v1/responses", json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    assert "[DONE]" not in text  # OpenAI's Responses stream ends with its last event
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    for number, (name, data) in enumerate(events):
        assert data["type"] == name and data["sequence_number"] == number
    return events


# ---- input translation -------------------------------------------------------------------


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "b"}, {"type": "text", "text": "c"}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "d"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "two"}],
        },
    ]
    call = lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}}  # noqa: E731
    assert input_messages(items) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "bc"},
        {
            "role": "assistant",
            "content": "d",
            "tool_calls": [call("c1", "f", '{"x": 1}'), call("c2", "g", "{}")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    lone = input_messages([{"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}])
    assert lone == [{"role": "assistant", "content": None, "tool_calls": [call("c", "f", "")]}]


@pytest.mark.parametrize(
    "item, words",
    [
        ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
        ({"type": "reasoning", "summary": []}, "'reasoning'"),
        ({"role": "tool", "content": "x"}, "input[0].role"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments"),
        ({"type": "function_call_output", "output": "x"}, "input[0].call_id"),
    ],
)
def test_input_items_that_cannot_be_served_are_400s_naming_them(item, words):
    with pytest.raises(APIError) as caught:
        input_messages([item])
    assert caught.value.status_code == 400 and caught.value.param == "input"
    assert words in caught.value.message


def test_the_chat_request_of_a_responses_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = ResponsesRequest.model_validate(
        {
            "input": "x",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "prompt_cache_key": "conversation-1",
            "seed": 3,
        }
    )
    messages = [{"role": "user", "content": "x"}]
    chat = chat_body(body, messages)
    assert chat == {
        "messages": messages,
        "stream": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "parallel_tool_calls": False,
        "prompt_cache_key": "conversation-1",
        "max_completion_tokens": 7,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema, "name": "s"}},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather of a city.",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    json_object = ResponsesRequest.model_validate(
        {"input": "x", "text": {"format": {"type": "json_object"}}}
    )
    assert chat_body(json_object, messages)["response_format"] == {"type": "json_object"}


# ---- answers -------------------------------------------------------------------------------


def test_a_string_input_is_answered_as_a_response(client):
    body = {"input": "hello", "max_output_tokens": 6, **GREEDY}
    answer = client.post("/v1/responses", json=body).json()
    assert answer["object"] == "response" and answer["id"].startswith("resp_")
    assert answer["status"] == "incomplete"  # max_output_tokens reached
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = answer["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "incomplete" and message["id"].startswith("msg_")
    [part] = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    usage = answer["usage"]
    num_prompt = prompt_len([{"role": "user", "content": "hello"}])
    assert usage["input_tokens"] == num_prompt and usage["output_tokens"] == 6
    assert usage["total_tokens"] == num_prompt + 6
    cached = usage["input_tokens_details"]["cached_tokens"]  # other tests may share a prefix
    assert cached < num_prompt
    assert answer["store"] is True and answer["max_output_tokens"] == 6
    assert answer["temperature"] == 0 and answer["tools"] == [] and answer["tool_choice"] == "auto"
    # The same conversation through chat completions gives the same text.
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, **GREEDY},
    ).json()
    assert part["text"] == chat["choices"][0]["message"]["content"]


def test_instructions_are_a_system_message_before_the_input(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    body = {"input": items, "instructions": "be brief", "max_output_tokens": 1, **GREEDY}
    answer = client.post("/v1/responses", json=body).json()
    expected = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert answer["usage"]["input_tokens"] == prompt_len(expected)
    assert answer["instructions"] == "be brief"


def test_a_stream_reassembles_to_the_answer(client):
    body = {"input": "stream me", "max_output_tokens": 8, **GREEDY}
    answer = client.post("/v1/responses", json=body).json()
    events = events_of(client, {**body, "stream": True})
    names = [name for name, _ in events]
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = answer["output"][0]["content"][0]["text"]
    assert "".join(deltas) == text
    created, final = events[0][1]["response"], events[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert final["id"] == created["id"] and final["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == text
    assert events[-3][1]["part"]["text"] == events[-4][1]["text"] == text
    assert final["usage"]["output_tokens"] == 8
    assert final["usage"]["input_tokens"] == answer["usage"]["input_tokens"]
    item_ids = {data["item_id"] for name, data in events if "item_id" in data}
    assert item_ids == {final["output"][0]["id"]}


def test_json_schema_text_format_is_followed(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    text_format = {"type": "json_schema", "name": "count", "schema": schema, "strict": True}
    body = {"input": "count", "text": {"format": text_format}, "max_output_tokens": 48}
    answer = client.post("/v1/responses", json={**body, "temperature": 0}).json()
    assert answer["status"] == "completed", answer
    parsed = json.loads(answer["output"][0]["content"][0]["text"])
    assert isinstance(parsed["ok"], bool) and set(parsed) == {"ok"}
    assert answer["text"]["format"]["name"] == "count"


# ---- the store and previous_response_id --------------------------------------------------


def test_a_stored_response_is_read_and_deleted(client):
    answer = client.post("/v1/responses", json={"input": "keep", "max_output_tokens": 2}).json()
    path = f"/v1/responses/{answer['id']}"
    assert client.get(path).json() == answer
    assert client.delete(path).json() == {
        "id": answer["id"],
        "object": "response.deleted",
        "deleted": True,
    }
    error = assert_error(client.get(path), 404)
    assert answer["id"] in error["message"] and error["code"] == "response_not_found"
    assert_error(client.delete(path), 404)


def test_store_false_is_not_kept(client):
    body = {"input": "forget", "max_output_tokens": 2, "store": False}
    answer = client.post("/v1/responses", json=body).json()
    assert answer["store"] is False
    assert_error(client.get(f"/v1/responses/{answer['id']}"), 404)
    follow = {"input": "more", "previous_response_id": answer["id"], "max_output_tokens": 1}
    error = assert_error(client.post("/v1/responses", json=follow), 404, "previous_response_id")
    assert error["code"] == "previous_response_not_found"


def test_a_second_turn_starts_with_the_first_turns_tokens_and_reuses_their_kv(client):
    tokenizer = ByteTokenizer()
    first = client.post(
        "/v1/responses",
        json={
            "input": "a first question",
            "instructions": "be brief",
            "max_output_tokens": 20,
            **GREEDY,
        },
    ).json()
    num_first = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    second = client.post(
        "/v1/responses",
        json={
            "input": "and a second",
            "instructions": "be brief",
            "previous_response_id": first["id"],
            "max_output_tokens": 20,
            **GREEDY,
        },
    ).json()
    assert second["previous_response_id"] == first["id"]
    # The prompt is turn 1's prompt and output as they were, then the rest as rendered.
    marked = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a first question"},
            {"role": "assistant", "content": "\0"},
            {"role": "user", "content": "and a second"},
        ]
    )
    after = marked.split("\0", 1)[1]
    assert second["usage"]["input_tokens"] == num_first + len(tokenizer.encode(after, False))
    # Every computed token of turn 1 is reused: its whole blocks and the partial block it ended
    # in (its last output token was never computed).
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == num_first - 1
    # A third turn reuses the whole second turn the same way.
    third = client.post(
        "/v1/responses",
        json={
            "input": "third",
            "instructions": "be brief",
            "previous_response_id": second["id"],
            "max_output_tokens": 2,
            **GREEDY,
        },
    ).json()
    num_second = second["usage"]["input_tokens"] + second["usage"]["output_tokens"]
    assert third["usage"]["input_tokens_details"]["cached_tokens"] == num_second - 1


def test_other_instructions_render_the_whole_conversation_again(client):
    first = client.post(
        "/v1/responses", json={"input": "q", "max_output_tokens": 4, **GREEDY}
    ).json()
    text = first["output"][0]["content"][0]["text"]
    second = client.post(
        "/v1/responses",
        json={
            "input": "r",
            "instructions": "new rules",
            "previous_response_id": first["id"],
            "max_output_tokens": 1,
            **GREEDY,
        },
    ).json()
    conversation = [
        {"role": "system", "content": "new rules"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "r"},
    ]
    assert second["usage"]["input_tokens"] == prompt_len(conversation)


# ---- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"input": []}, "input"),
        ({"input": [1, 2]}, "input"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"model": "other"}, "model"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(scripted_client, extra, param):
    response = scripted_client.post("/v1/responses", json={"input": "x", **extra})
    assert_error(response, 404 if param == "model" else 400, param)


def test_errors_of_the_chat_request_speak_of_the_responses_fields(scripted_client):
    too_many = {"input": "x", "max_output_tokens": 1000}
    error = assert_error(
        scripted_client.post("/v1/responses", json=too_many), 400, "max_output_tokens"
    )
    assert "max_output_tokens=1000" in error["message"]
    assert "max_completion_tokens" not in error["message"]
    unnamed = {"input": "x", "tools": [{"type": "function", "name": "no spaces"}]}
    error = assert_error(scripted_client.post("/v1/responses", json=unnamed), 400, "tools[0].name")
    assert error["message"].startswith("tools[0].name ")


def test_fields_that_change_nothing_are_accepted(scripted_client):
    body = {
        "input": "x",
        "reasoning": {"effort": "low"},
        "include": ["reasoning.encrypted_content"],
        "metadata": {"a": "b"},
        "user": "u",
        "service_tier": "auto",
        "background": False,
        "truncation": "disabled",
        "stream_options": None,
    }
    answer = scripted_client.post("/v1/responses", json=body).json()
    assert answer["metadata"] == {"a": "b"} and answer["reasoning"] == {"effort": "low"}
    assert answer["output"][0]["content"][0]["text"] == "ab"


def test_a_failure_mid_stream_is_an_error_event(scripted, scripted_client):
    scripted.fail_after = ReplicaFailedError("replica 3 died")
    events = events_of(scripted_client, {"input": "x", "stream": True})
    name, data = events[-1]
    assert name == "error" and data["code"] == "replica_failed"
    assert "replica 3 died" in data["message"]
    assert [n for n, _ in events[:-1]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]


# ---- API keys ------------------------------------------------------------------------------


@pytest.fixture
def keyed() -> Iterator[TestClient]:
    app = create_app(ScriptedBackend(), api_key=["key-one", "key-two"])
    with TestClient(app) as client:
        yield client


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_each_key_sees_only_its_own_responses(keyed):
    answer = keyed.post("/v1/responses", json={"input": "x"}, headers=auth("key-one")).json()
    path = f"/v1/responses/{answer['id']}"
    assert keyed.get(path, headers=auth("key-one")).status_code == 200
    assert_error(keyed.get(path, headers=auth("key-two")), 404)
    assert_error(keyed.delete(path, headers=auth("key-two")), 404)
    follow = {"input": "y", "previous_response_id": answer["id"]}
    wrong_key = keyed.post("/v1/responses", json=follow, headers=auth("key-two"))
    assert_error(wrong_key, 404, "previous_response_id")
    assert keyed.post("/v1/responses", json=follow, headers=auth("key-one")).status_code == 200
    assert_error(keyed.get(path, headers=auth("key-three")), 401)
    assert keyed.delete(path, headers=auth("key-one")).status_code == 200


def test_the_store_bounds_are_the_apps(scripted):
    app = create_app(scripted, response_store=ResponseStoreConfig(max_responses=2))
    with TestClient(app) as client:
        ids = [client.post("/v1/responses", json={"input": str(i)}).json()["id"] for i in range(3)]
        assert [client.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]


def test_a_continuation_drops_the_eos_the_template_writes_itself():
    tokenizer = ByteTokenizer()
    history = [{"role": "user", "content": "hi"}]
    previous = StoredResponse.build(
        "resp_1",
        b"{}",
        None,
        history,
        [{"role": "assistant", "content": "yo"}],
        [9, 9, 9],
        [ord("y"), ord("o"), ByteTokenizer.EOS],
    )

    def render(messages: list[dict], tools: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages)

    new = [{"role": "user", "content": "again"}]
    after = list(b"\n<|user|>\nagain\n<|assistant|>\n")
    ids = continuation_ids(tokenizer, render, previous, [], None, new, [])
    assert ids == [9, 9, 9, ord("y"), ord("o"), *after]
    # Other instructions than the previous turn's: no continuation, the caller renders all.
    assert continuation_ids(tokenizer, render, previous, [], "rules", new, []) is None
    tool = [{"type": "function", "function": {"name": "f"}}]
    # Tools are rendered before the conversation: other tools than the previous turn's change
    # what its prompt tokens stand for.
    shows_tools = lambda messages, tools: str(tools) + render(messages, tools)  # noqa: E731
    assert continuation_ids(tokenizer, shows_tools, previous, [], None, new, tool) is None
    same = continuation_ids(tokenizer, shows_tools, previous, tool, None, new, tool)
    assert same == [9, 9, 9, ord("y"), ord("o"), *after]
