"""OpenAI's prompt-cache fields: accepted shapes, 400s naming the field, breakpoint positions and
the hints a request carries to the backend."""

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.api.serving import Serving
from cluster.backend import LocalBackend
from cluster.metrics import StrataMetrics
from replicas.cache_hints import CacheHints
from replicas.config import EngineConfig, KVOffloadConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.hashing import block_hashes

SYSTEM = "You are a careful assistant. " * 4  # 116 characters


def chat(content, **fields) -> dict:
    return (
        {"messages": [{"role": "system", "content": content}, {"role": "user", "content": "hi"}]}
        | {"max_tokens": 2}
        | fields
    )


@pytest.fixture(scope="module")
def serving(engine) -> Serving:
    return Serving(LocalBackend(engine), StrataMetrics(), 64)


def hints_of(serving: Serving, body: dict) -> CacheHints | None:
    if "messages" in body:
        return serving.chat(ChatCompletionRequest.model_validate(body)).cache_hints
    return serving.completion(CompletionRequest.model_validate(body)).cache_hints


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        (
            {"prompt_cache_options": {"ttl": "7m"}},
            "prompt_cache_options",
            "prompt_cache_options.ttl",
        ),
        ({"prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options", "mode"),
        ({"prompt_cache_retention": "48h"}, "prompt_cache_retention", "prompt_cache_retention"),
        ({"prompt_cache_key": 7}, "prompt_cache_key", "prompt_cache_key"),
        ({"service_tier": "fast"}, "service_tier", "service_tier 'fast'"),
    ],
)
def test_a_lifetime_not_offered_is_a_400_naming_the_field(client, fields, param, named):
    for path, body in (
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2} | fields),
        ("/v1/chat/completions", chat("hello") | fields),
    ):
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and named in error["message"]


def test_a_breakpoint_lifetime_not_offered_is_a_400_naming_it(client):
    parts = [
        {
            "type": "text",
            "text": SYSTEM,
            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "2m"},
        }
    ]
    response = client.post("/v1/chat/completions", json=chat(parts))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "prompt_cache_breakpoint.ttl" in error["message"] and "'2m'" in error["message"]


def test_the_openai_client_shapes_are_served(client):
    parts = [
        {
            "type": "text",
            "text": SYSTEM,
            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
        },
        {"type": "text", "text": "Question follows."},
    ]
    body = chat(
        parts,
        prompt_cache_key="tenant-a/session-1",
        prompt_cache_options={"mode": "implicit", "ttl": "30m"},
        prompt_cache_retention="24h",
    )
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    completion = {"prompt": "hello", "max_tokens": 2, "prompt_cache_key": "k"}
    completion |= {"prompt_cache_retention": "in_memory"}
    assert client.post("/v1/completions", json=completion).status_code == 200


def test_a_breakpoint_ends_where_its_part_ends_in_the_rendered_prompt(serving, engine):
    parts = [
        {"type": "text", "text": SYSTEM, "prompt_cache_breakpoint": {"mode": "explicit"}},
        {"type": "text", "text": "Then more text that is not retained."},
    ]
    hints = hints_of(serving, chat(parts))
    rendered = engine.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}])
    expected = rendered[: rendered.index(SYSTEM) + len(SYSTEM)]
    assert hints.retain_tokens == len(engine.tokenizer.encode(expected))
    assert hints.ttl_s == 1800.0  # a breakpoint without a ttl takes the default 30m
    assert hints.key is None
    assert hints.retained_blocks(16, 10_000) == hints.retain_tokens // 16


def test_the_longest_lifetime_covers_the_prefix_up_to_the_last_breakpoint(serving):
    first = {
        "type": "text",
        "text": SYSTEM,
        "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
    }
    second = {
        "type": "text",
        "text": "Tail.",
        "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "5m"},
    }
    one = hints_of(serving, chat([first]))
    both = hints_of(serving, chat([first, second], prompt_cache_options={"mode": "explicit"}))
    assert both.retain_tokens == one.retain_tokens + len("Tail.")  # one byte per character
    assert both.ttl_s == 43200.0


def test_implicit_mode_retains_the_whole_prompt_only_with_a_lifetime(serving, engine):
    body = {"prompt": "x" * 100, "max_tokens": 2}
    num_tokens = len(engine.tokenizer.encode("x" * 100))
    assert hints_of(serving, body) is None
    assert hints_of(serving, body | {"prompt_cache_retention": "in_memory"}) is None
    day = hints_of(serving, body | {"prompt_cache_retention": "24h"})
    assert (day.retain_tokens, day.ttl_s) == (num_tokens, 86400.0)
    hour = hints_of(serving, body | {"prompt_cache_options": {"ttl": "1h"}})
    assert (hour.retain_tokens, hour.ttl_s) == (num_tokens, 3600.0)
    explicit = hints_of(serving, body | {"prompt_cache_options": {"mode": "explicit", "ttl": "1h"}})
    assert explicit is None  # explicit mode without a breakpoint retains nothing
    keyed = hints_of(serving, body | {"prompt_cache_key": "k"})
    assert keyed == CacheHints(key="k")


def test_chat_without_prompt_cache_fields_carries_no_hints(serving):
    assert hints_of(serving, chat([{"type": "text", "text": SYSTEM}])) is None


def test_the_hints_reach_the_backend_over_http(scripted, scripted_client):
    body = {"prompt": "x" * 40, "max_tokens": 2, "prompt_cache_key": "user-7"}
    body |= {"prompt_cache_options": {"ttl": "5m"}}
    assert scripted_client.post("/v1/completions", json=body).status_code == 200
    assert scripted.cache_hints == CacheHints("user-7", 41, 300.0)  # BOS + 40 bytes
    assert scripted_client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert scripted.cache_hints is None


def test_a_retained_prompt_is_counted_in_metrics_and_survives_host_churn():
    """Over HTTP, on an engine with a small host tier: a prompt sent with
    prompt_cache_retention 24h stays on host while ordinary prompts churn through it."""
    config = EngineConfig(
        model="tiny",
        num_npu_blocks=24,
        max_model_len=256,
        scheduler_config=SchedulerConfig(
            kv_offload_config=KVOffloadConfig(
                enabled=True,
                host_memory_ratio=1.0,
                write_through_threshold="immediate",
                retained_share=0.5,
            )
        ),
    )
    engine = Engine(config)
    kept = "k" * 64  # BOS + 64 bytes: 4 whole blocks
    with TestClient(create_app(LocalBackend(engine), max_tokens_limit=8)) as http:
        body = {"prompt": kept, "max_tokens": 1, "prompt_cache_retention": "24h"}
        assert http.post("/v1/completions", json=body).status_code == 200
        for i in range(8):  # 8 x 4 ordinary blocks through a host tier of 24
            filler = {"prompt": chr(ord("a") + i) * 64, "max_tokens": 1}
            assert http.post("/v1/completions", json=filler).status_code == 200
        metrics = http.get("/metrics").text
    series = 'strata_kv_retained_blocks{cache_type="full",replica="0",tier="host"} 4.0'
    assert series in metrics
    hashes = block_hashes(engine.tokenizer.encode(kept), 16)
    assert all(engine.kv_cache.host.lookup(h) is not None for h in hashes)
    first_filler = block_hashes(engine.tokenizer.encode("a" * 64), 16)
    assert engine.kv_cache.host.lookup(first_filler[0]) is None  # ordinary: churned out
    engine.check_integrity()


def test_service_tier_sets_the_class_and_an_unset_one_leaves_the_tenants_default(serving):
    assert hints_of(serving, chat("hi", service_tier="flex")) == CacheHints(batch=True)
    assert hints_of(serving, {"prompt": "hi", "service_tier": "priority"}).batch is False
    assert hints_of(serving, chat("hi")) is None
