"""Every client mistake gets its 4xx in OpenAI's error shape, and the server keeps serving."""

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.backend import LocalBackend, NoLiveReplicaError, OverloadedError, ReplicaFailedError
from tests.unit.api.conftest import MAX_MODEL_LEN, NoTemplateTokenizer, ScriptedBackend

OK_BODY = {"prompt": "hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


def assert_still_serving(client: TestClient) -> None:
    response = client.post("/v1/completions", json=OK_BODY)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


BAD_COMPLETIONS = [
    # (raw body, param named in the error, a word the message must contain)
    (b"{", None, "JSON"),
    (b"\xff\xfe", None, "JSON"),
    (b"[1, 2]", None, "object"),
    (b'"hello"', None, "object"),
    (b'{"prompt": 5}', "prompt", "prompt"),
    (b'{"prompt": ["a", [1]]}', "prompt", "token-id lists"),
    (b'{"prompt": [[1, 2], []]}', "prompt", "empty"),
    (b'{"prompt": [1, true]}', "prompt", "token ids"),
    (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 65}', "max_tokens", "allows"),
    (b'{"prompt": "x", "temperature": -1}', "temperature", "temperature"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature", "temperature"),
    (b'{"prompt": "x", "top_p": 0}', "top_p", "top_p"),
    (b'{"prompt": "x", "top_k": -2}', "top_k", "top_k"),
    (b'{"prompt": "x", "min_p": 1.5}', "min_p", "min_p"),
    (b'{"prompt": "x", "stop": 5}', "stop", "stop"),
    (b'{"prompt": "x", "stop": [""]}', "stop", "stop"),
    (b'{"prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids", "stop_token_ids"),
    (b'{"prompt": "x", "seed": "s"}', "seed", "seed"),
    (b'{"prompt": "x", "n": 0}', "n", "n must"),
    (b'{"prompt": "x", "n": 4, "best_of": 2}', "best_of", "best_of"),
    (b'{"prompt": "x", "n": 200}', "n", "sequences"),
    (b'{"prompt": "x", "logprobs": 6}', "logprobs", "logprobs"),
    (b'{"prompt": "x", "logprobs": -1}', "logprobs", "logprobs"),
    (b'{"prompt": "x", "best_of": 3, "stream": true}', "best_of", "streamed"),
    (b'{"prompt": "x", "frequency_penalty": 2.5}', "frequency_penalty", "frequency_penalty"),
    (b'{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty", "repetition_penalty"),
    (b'{"prompt": "x", "logit_bias": {"x": 1}}', "logit_bias", "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias", "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"999": 1}}', "logit_bias", "999"),
    (b'{"prompt": "x", "min_tokens": 20, "max_tokens": 4}', "min_tokens", "min_tokens"),
    (b'{"prompt": "x", "suffix": "y"}', "suffix", "suffix"),
    (
        b'{"prompt": "x", "response_format": {"type": "json_schema"}}',
        "response_format",
        "json_schema",
    ),
    (
        b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": '
        b'{"name": "a", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}',
        "response_format",
        "schema",
    ),
    (b'{"prompt": "x", "structured_outputs": {"regex": "(a"}}', "structured_outputs", "regex"),
    (b'{"prompt": "x", "structured_outputs": {"choice": []}}', "structured_outputs", "choice"),
    (
        b'{"prompt": "x", "structured_outputs": {"grammar": "start: (("}}',
        "structured_outputs",
        "grammar",
    ),
    (
        b'{"prompt": "x", "structured_outputs": {"grammar": "root ::= ("}}',
        "structured_outputs",
        "GBNF",
    ),
    (
        b'{"prompt": "x", "structured_outputs": {"structural_tag": "t"}}',
        "structured_outputs",
        "got none",
    ),
    (
        b'{"prompt": "x", "guided_regex": "a+", "response_format": {"type": "json_object"}}',
        "response_format",
        "several",
    ),
    (b'{"prompt": "x", "stream": "yes"}', "stream", "stream"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options", "stream"),
    (b'{"prompt": "x", "presence_penalty": -3}', "presence_penalty", "presence_penalty"),
    (b'{"prompt": "x", "cache_salt": ""}', "cache_salt", "cache_salt"),
    (b'{"prompt": [300]}', "prompt", "vocabulary"),
    (b'{"prompt": []}', "prompt", "empty"),
]


@pytest.mark.parametrize(("raw", "param", "word"), BAD_COMPLETIONS)
def test_bad_completion_body_is_400(client, raw, param, word):
    response = client.post(
        "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    error = assert_error(response, 400, param)
    assert error["type"] == "invalid_request_error"
    assert word in error["message"]


def test_unknown_fields_are_ignored_and_logged_by_name(client, caplog):
    body = {**OK_BODY, "frobnicate": 1, "stream": True}
    body["stream_options"] = {"include_usage": True, "chunk_size": 3}
    with caplog.at_level("WARNING", logger="cluster.api.app"):
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    warnings = [r.getMessage() for r in caplog.records if "ignoring fields" in r.getMessage()]
    assert len(warnings) == 1
    assert "frobnicate" in warnings[0] and "stream_options.chunk_size" in warnings[0]
    chat = {"messages": [{"role": "user", "content": "hi", "audio_ref": 1}], "max_tokens": 2}
    with caplog.at_level("WARNING", logger="cluster.api.app"):
        response = client.post("/v1/chat/completions", json={**chat, "metadata": {"a": "b"}})
    assert response.status_code == 200, response.text
    assert "messages.0.audio_ref" in caplog.records[-1].getMessage()
    assert "metadata" not in caplog.records[-1].getMessage()  # known, and changes nothing
    assert_still_serving(client)


@pytest.mark.parametrize(
    "field",
    [
        {"structured_outputs": {"grammar": 'start: "yes" | "no"'}},
        {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},  # GBNF
        {"guided_grammar": 'start: "yes" | "no"'},
    ],
)
def test_a_grammar_is_served_and_not_logged_as_ignored(client, caplog, field):
    """The log agrees with the answer: a grammar is a known field, and the output follows it."""
    with caplog.at_level("WARNING", logger="cluster.api.app"):
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, **field})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in ("yes", "no")
    assert not [r for r in caplog.records if "ignoring fields" in r.getMessage()]


def test_an_unknown_structured_outputs_field_is_logged_and_named_in_the_400(client, caplog):
    with caplog.at_level("WARNING", logger="cluster.api.app"):
        body = {"prompt": "x", "structured_outputs": {"structural_tag": "t"}}
        response = client.post("/v1/completions", json=body)
    error = assert_error(response, 400, "structured_outputs")
    assert "grammar" in error["message"]  # among the fields it may set
    [warning] = [r.getMessage() for r in caplog.records if "ignoring fields" in r.getMessage()]
    assert "structured_outputs.structural_tag" in warning and "grammar" not in warning


def test_neutral_values_of_optional_parameters_are_accepted(client):
    body = {**OK_BODY, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    response = client.post(
        "/v1/completions", json={**body, "echo": False, "logprobs": None, "best_of": 1}
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 65},
            "max_completion_tokens",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
            "top_logprobs",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}}, "audio"),
        ({"messages": [{"role": "user", "content": "hi"}], "functions": [{}]}, "functions"),
        ({"messages": [{"role": "user", "content": "hi"}], "prediction": {}}, "prediction"),
        ({"messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}, "modalities"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
    ],
)
def test_bad_chat_body_is_400(client, body, param):
    response = client.post("/v1/chat/completions", json=body)
    error = assert_error(response, 400, param)
    assert error["type"] == "invalid_request_error"


def test_prompt_too_long_is_400(client):
    for prompt in ("x" * MAX_MODEL_LEN, list(range(200)) * 3):
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        error = assert_error(response, 400, "prompt")
        assert f"{MAX_MODEL_LEN}" in error["message"]
    long_chat = {"messages": [{"role": "user", "content": "y" * MAX_MODEL_LEN}]}
    assert_error(client.post("/v1/chat/completions", json=long_chat), 400, "messages")
    assert_still_serving(client)


def test_prompt_plus_max_tokens_over_context_is_400(client):
    prompt = "z" * (MAX_MODEL_LEN - 10)  # 1 BOS + 502 bytes: room for 9 tokens
    error = assert_error(
        client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10}), 400, "max_tokens"
    )
    assert "maximum context length" in error["message"]
    # Without max_tokens, the default of 16 is shortened to fit.
    response = client.post("/v1/completions", json={"prompt": prompt, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 9


def test_unknown_model_is_404(client):
    error = assert_error(
        client.post("/v1/completions", json={**OK_BODY, "model": "gpt-9"}), 404, "model"
    )
    assert error["code"] == "model_not_found"
    assert_error(client.get("/v1/models/gpt-9"), 404, "model")
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_still_serving(client)


def test_unknown_route_and_wrong_method(client):
    assert assert_error(client.get("/v1/nothing"), 404)["code"] == "not_found"
    for method, path in [("POST", "/metrics"), ("GET", "/v1/completions"), ("DELETE", "/health")]:
        response = client.request(method, path)
        assert assert_error(response, 405)["code"] == "method_not_allowed"
        assert "allow" in response.headers
    assert_still_serving(client)


def test_body_over_limit_is_413(engine):
    app = create_app(LocalBackend(engine), max_request_body_bytes=1000)
    with TestClient(app) as client:
        big = json.dumps({"prompt": "x" * 2000}).encode()
        response = client.post("/v1/completions", content=big)
        assert assert_error(response, 413)["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit is enforced while reading
            yield big[:600]
            yield big[600:]

        assert_error(client.post("/v1/completions", content=chunks()), 413)
        response = client.post("/v1/completions", json={"prompt": "x" * 500, "max_tokens": 1})
        assert response.status_code == 200, response.text


def test_chat_without_template_is_400():
    with TestClient(create_app(ScriptedBackend(NoTemplateTokenizer()))) as client:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        error = assert_error(client.post("/v1/chat/completions", json=body), 400, "messages")
        assert "chat template" in error["message"]
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        (OverloadedError("12 requests are already waiting; retry later"), 429, "overloaded"),
        (NoLiveReplicaError("no replica is alive"), 503, "no_live_replica"),
        (ReplicaFailedError("replica 3 died"), 503, "replica_failed"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_backend_failures_before_output(scripted, scripted_client, failure, status, code, stream):
    scripted.fail_before = failure
    body = {"prompt": "hi", "stream": stream}
    error = assert_error(scripted_client.post("/v1/completions", json=body), status)
    assert error["code"] == code and error["message"] == str(failure)
    scripted.fail_before = None
    assert scripted_client.post("/v1/completions", json=body).status_code == 200


def test_overloaded_local_backend_is_429(engine):
    with TestClient(create_app(LocalBackend(engine, max_waiting_requests=0))) as client:
        response = client.post("/v1/completions", json=OK_BODY)
        assert assert_error(response, 429)["type"] == "rate_limit_error"
        assert response.headers["retry-after"] == "1"


def test_replica_failure_mid_stream_is_an_error_event(scripted, scripted_client):
    scripted.fail_after = ReplicaFailedError("replica 3 died")
    response = scripted_client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert response.status_code == 200
    events = [line for line in response.text.split("\n\n") if line]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "a"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and error["message"] == "replica 3 died"
    assert events[2] == "data: [DONE]"
    scripted.fail_after = None
    assert scripted_client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200


def test_unexpected_server_error_is_a_generic_500(scripted, scripted_client, caplog):
    scripted.fail_before = RuntimeError("secret internals")
    for stream in (False, True):
        response = scripted_client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        error = assert_error(response, 500)
        assert error["type"] == "server_error" and "secret" not in error["message"]
    assert "secret internals" in caplog.text  # logged for the operator
    scripted.fail_before = None
    assert scripted_client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200


def test_health_follows_live_replicas(scripted, scripted_client):
    health = scripted_client.get("/health").json()
    assert (health["status"], health["live_replicas"]) == ("ok", 1)
    scripted.num_live = 0
    response = scripted_client.get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_live_replica"
