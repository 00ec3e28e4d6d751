"""POST /v1/admin/reset_prefix_cache (and vLLM's /reset_prefix_cache, SGLang's /flush_cache):
the tier from the body or the query, bad tiers refused with an OpenAI-style 400, and a real
engine's cached blocks gone afterwards. HEAD on every GET path."""

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.backend import LocalBackend
from replicas.config import EngineConfig, KVOffloadConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.events import Tier
from tests.unit.api.test_errors import assert_error

PATH = "/v1/admin/reset_prefix_cache"


@pytest.mark.parametrize(
    ("kwargs", "tier"),
    [
        ({}, "all"),
        ({"json": {}}, "all"),
        ({"json": {"tier": "npu"}}, "npu"),
        ({"params": {"tier": "host"}}, "host"),
        ({"json": {"tier": "host"}, "params": {"tier": "host"}}, "host"),
    ],
)
def test_the_tier_comes_from_the_body_or_the_query(scripted, scripted_client, kwargs, tier):
    response = scripted_client.post(PATH, **kwargs)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok", "tier": tier}
    assert scripted.resets == [tier]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"json": {"tier": "tape"}},
        {"params": {"tier": "everything"}},
        {"json": {"tier": 1}},
        {"json": {"tier": "npu"}, "params": {"tier": "host"}},
        {"json": {"tiers": "npu"}},
        {"params": {"level": "npu"}},
        {"content": b"{"},
    ],
)
def test_bad_requests_are_400_and_reset_nothing(scripted, scripted_client, kwargs):
    error = assert_error(scripted_client.post(PATH, **kwargs), 400, param=_param(kwargs))
    assert error["type"] == "invalid_request_error"
    assert scripted.resets == []
    assert scripted_client.post(PATH).status_code == 200  # still serving


@pytest.mark.parametrize("path", ["/reset_prefix_cache", "/flush_cache"])
def test_vllms_and_sglangs_reset_paths_are_the_admin_reset(scripted, scripted_client, path):
    assert scripted_client.post(path).json() == {"status": "ok", "tier": "all"}
    # vLLM's query flags: what Strata does anyway is accepted, the rest refused by name.
    flags = {"reset_external": "true", "reset_connector": "false"}
    assert scripted_client.post(path, params=flags).status_code == 200
    assert scripted_client.post(path, json={"tier": "npu"}).json()["tier"] == "npu"
    error = assert_error(
        scripted_client.post(path, params={"reset_running_requests": "true"}),
        400,
        param="reset_running_requests",
    )
    assert "not served" in error["message"]
    assert_error(scripted_client.get(path), 405)  # a reset is never a GET (nor a HEAD)
    assert_error(scripted_client.post(path, params={"tier": "tape"}), 400, param="tier")
    assert scripted.resets == ["all", "all", "npu"]


def test_head_is_answered_on_every_get_path(scripted_client):
    app = scripted_client.app
    paths = {
        route.path.replace("{response_id}", "resp_x").replace("{model:path}", "scripted")
        for route in app.routes
        if "GET" in getattr(route, "methods", ())
    }
    assert {"/metrics", "/health", "/v1/models", "/tokenizer_info"} <= paths
    for path in sorted(paths):
        got, head = scripted_client.get(path), scripted_client.head(path)
        assert head.status_code == got.status_code != 405, path
        assert head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path
        if path not in ("/metrics", "/health"):  # their bodies change between two calls
            assert head.headers["content-length"] == str(len(got.content)), path
    assert scripted_client.head("/metrics").status_code == 200
    head = scripted_client.head("/v1/completions")  # no GET there: no HEAD either
    assert head.status_code == 405 and head.headers["allow"] == "POST"


def _param(kwargs: dict) -> str | None:
    body = kwargs.get("json") or kwargs.get("params") or {}
    if "content" in kwargs:
        return None
    return next(iter(body))


def test_reset_forgets_the_engines_cached_blocks_by_tier():
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=1.0, write_through_threshold=1)
    engine = Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=64,
            scheduler_config=SchedulerConfig(kv_offload_config=offload),
        )
    )
    prompt = {"prompt": "a long shared prefix " * 8, "max_tokens": 2}
    with TestClient(create_app(LocalBackend(engine))) as client:
        for _ in range(3):  # the third request hits, promoting its blocks to host
            assert client.post("/v1/completions", json=prompt).status_code == 200
        usage = engine.stats().cache_types["full"]
        assert usage.of(Tier.NPU).num_cached > 0 and usage.of(Tier.HOST).num_cached > 0

        assert client.post(PATH, json={"tier": "npu"}).status_code == 200
        usage = engine.stats().cache_types["full"]
        assert usage.of(Tier.NPU).num_cached == 0 and usage.of(Tier.HOST).num_cached > 0

        assert client.post(PATH, params={"tier": "host"}).status_code == 200
        assert engine.stats().cache_types["full"].of(Tier.HOST).num_cached == 0
        response = client.post("/v1/completions", json=prompt)
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    engine.check_integrity()
