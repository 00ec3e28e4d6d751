"""POST /v1/admin/reset_prefix_cache: the tier from the body or the query, bad tiers refused
with an OpenAI-style 400, and a real engine's cached blocks gone afterwards."""

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
