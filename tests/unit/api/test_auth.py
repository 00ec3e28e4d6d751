"""The API key guards every path except /health (and /metrics while it is public)."""

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from tests.unit.api.conftest import ScriptedBackend
from tests.unit.api.test_errors import assert_error

KEY = "sk-strata-test"
GOOD = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"prompt": "hi"}


@pytest.fixture(params=[True, False], ids=["metrics-public", "metrics-private"])
def guarded(request):
    app = create_app(ScriptedBackend(), api_key=KEY, metrics_public=request.param)
    with TestClient(app) as client:
        yield client, request.param


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Api-Key": KEY}],
    ids=["missing", "wrong", "no-scheme", "other-header"],
)
def test_requests_without_the_key_are_401(guarded, headers):
    client, _ = guarded
    for method, path, body in [
        ("POST", "/v1/completions", COMPLETION),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/unknown", None),
        ("POST", "/v1/admin/reset_prefix_cache", {"tier": "all"}),
        ("POST", "/reset_prefix_cache", None),  # vLLM's path: the same rule
        ("POST", "/flush_cache", None),  # SGLang's
        ("HEAD", "/v1/models", None),
    ]:
        response = client.request(method, path, json=body, headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        if method != "HEAD":
            assert assert_error(response, 401)["code"] == "invalid_api_key"


def test_the_key_opens_every_endpoint(guarded):
    client, _ = guarded
    assert client.post("/v1/completions", json=COMPLETION, headers=GOOD).status_code == 200
    assert client.get("/v1/models", headers=GOOD).status_code == 200
    assert client.get("/metrics", headers=GOOD).status_code == 200
    for path in ("/v1/admin/reset_prefix_cache", "/reset_prefix_cache", "/flush_cache"):
        assert client.post(path, headers=GOOD).status_code == 200
    # Authorized mistakes still get their own status.
    assert_error(client.get("/v1/unknown", headers=GOOD), 404)
    assert_error(client.post("/v1/completions", content=b"{", headers=GOOD), 400)


def test_health_is_public_and_metrics_as_configured(guarded):
    client, metrics_public = guarded
    assert client.get("/health").status_code == 200
    response = client.get("/metrics")
    if metrics_public:
        assert response.status_code == 200
    else:
        assert_error(response, 401)
