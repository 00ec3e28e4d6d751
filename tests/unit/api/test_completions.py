"""Completions and chat completions over the in-process engine: bodies, chunks, usage."""

import json

import httpx

from replicas.model.tokenizer import ByteTokenizer
from tests.unit.api.conftest import BLOCK_SIZE

GREEDY = {"temperature": 0, "ignore_eos": True}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def parse_sse(response: httpx.Response) -> list:
    """The events of a stream: JSON bodies, then the final "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("\n\n")
    events = []
    for event in response.text.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_completion_body(client):
    response = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, **GREEDY})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str)
    assert body["usage"] == {
        "prompt_tokens": 6,  # BOS + 5 bytes
        "completion_tokens": 3,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_prompt_shapes_agree(client):
    """A string, its token ids, and a list holding either are the same prompt."""
    token_ids = ByteTokenizer().encode("same prompt")
    texts = set()
    for prompt in ("same prompt", token_ids, ["same prompt"], [token_ids]):
        body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **GREEDY})
        assert body.status_code == 200, body.text
        assert body.json()["usage"]["prompt_tokens"] == len(token_ids)
        texts.add(body.json()["choices"][0]["text"])
    assert len(texts) == 1


def test_completion_stream_chunks(client):
    body = {"prompt": "stream me", "max_tokens": 5, "stream": True, **GREEDY}
    events = parse_sse(client.post("/v1/completions", json=body))
    ids = {event["id"] for event in events}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for event in events:
        assert event["object"] == "text_completion" and event["model"] == "tiny"
        assert len(event["choices"]) == 1
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert all(e["usage"] is None for e in events)
    streamed = "".join(e["choices"][0]["text"] for e in events)
    whole = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert streamed == whole["choices"][0]["text"]


def test_stream_usage_chunk(client):
    body = {"prompt": "count me", "max_tokens": 4, "stream": True, **GREEDY}
    events = parse_sse(
        client.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    )
    *chunks, last = events
    assert last["choices"] == [] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["prompt_tokens"] == 9 and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["total_tokens"] == 13


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "count me", "max_tokens": 4, "stream": True, **GREEDY}
    events = parse_sse(client.post("/v1/completions", json={**body, "stream_options": options}))
    *chunks, last = events
    assert all(c["usage"]["prompt_tokens"] == 9 for c in chunks)
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 4
    for chunk in chunks:  # each chunk's count is the tokens streamed up to it
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert last["usage"]["completion_tokens"] == 4 and last["choices"] == []
    chat = {"messages": MESSAGES, "max_tokens": 3, "stream": True, **GREEDY}
    events = parse_sse(
        client.post("/v1/chat/completions", json={**chat, "stream_options": options})
    )
    assert events[-2]["usage"]["completion_tokens"] == 3
    # The first (role) chunk too, before any token: vLLM's shape.
    role, *rest = events
    assert role["choices"][0]["delta"]["role"] == "assistant"
    num_prompt = events[-1]["usage"]["prompt_tokens"]
    assert role["usage"]["prompt_tokens"] == num_prompt > 0
    assert role["usage"]["completion_tokens"] == 0 and role["usage"]["total_tokens"] == num_prompt
    assert all(c["usage"] is not None for c in rest)
    # The prompt cached the second time: the role chunk says so already.
    again = parse_sse(client.post("/v1/chat/completions", json={**chat, "stream_options": options}))
    cached = again[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached > 0


def test_repeated_prompt_reports_cached_tokens(client, engine):
    prompt = "A long shared system prompt about caching. " * 3  # 129 bytes + BOS
    # A salt of its own: no earlier request's partial first block (BOS) is reused.
    body = {"prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-a", **GREEDY}
    first = client.post("/v1/completions", json=body).json()["usage"]
    second = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] == 130
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # Every token but the last, which is always computed: 8 whole blocks, and the first's
    # partial block (its 2 computed prompt tokens, copied).
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == 130 - 1 and 130 // BLOCK_SIZE * BLOCK_SIZE == 128
    # Another tenant's salt shares nothing.
    salted = client.post("/v1/completions", json={**body, "cache_salt": "tenant-b"}).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    engine.check_integrity()


def test_chat_renders_the_template(client):
    expected = ByteTokenizer().encode(ByteTokenizer().apply_chat_template(MESSAGES))
    body = {"messages": MESSAGES, "max_tokens": 3, **GREEDY}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"].startswith("chatcmpl-") and answer["object"] == "chat.completion"
    [choice] = answer["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == len(expected)
    assert answer["usage"]["completion_tokens"] == 3
    # Text parts are the same message as a string.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    same = client.post("/v1/chat/completions", json={**body, "messages": parts}).json()
    assert same["choices"][0]["message"] == choice["message"]


def test_chat_max_completion_tokens_wins(client):
    body = {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 2, **GREEDY}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["completion_tokens"] == 2


def test_chat_stream_chunks(client):
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": True, **GREEDY}
    body["stream_options"] = {"include_usage": True}
    events = parse_sse(client.post("/v1/chat/completions", json=body))
    *chunks, usage = events
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in e["choices"][0]["delta"] for e in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks)
    whole = client.post(
        "/v1/chat/completions", json={**body, "stream": False, "stream_options": None}
    )
    assert streamed == whole.json()["choices"][0]["message"]["content"]


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [("tiny", "model")]
    health = client.get("/health").json()
    assert (health["status"], health["live_replicas"]) == ("ok", 1)
    assert health["event_loop"] == {"stalls": 0, "longest_stall_s": 0.0, "blocked_s": 0.0}
