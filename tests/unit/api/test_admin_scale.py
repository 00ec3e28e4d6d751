"""``POST /v1/admin/scale``: the result of a resize, a 400 naming data_parallel_size for a bad
size, a 409 for a deployment that cannot be resized, and the API key when one is set."""

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.backend import ScaleResult
from tests.reliability.conftest import assert_openai_error
from tests.unit.api.conftest import ScriptedBackend


class ResizableBackend(ScriptedBackend):
    """Two replicas that resize on request; more than four do not fit."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 2
        self.calls: list[int] = []

    async def scale(self, data_parallel_size: int) -> ScaleResult:
        self.calls.append(data_parallel_size)
        if data_parallel_size > 4:
            raise ValueError(f"data_parallel_size {data_parallel_size} is more than fits")
        old, self.size = self.size, data_parallel_size
        if data_parallel_size < old:
            return ScaleResult(old, data_parallel_size, removed=(1,), reasons={1: "least"})
        return ScaleResult(old, data_parallel_size, added=tuple(range(old, data_parallel_size)))

    def num_replicas(self) -> int:
        return self.size


@pytest.fixture
def resizable() -> ResizableBackend:
    return ResizableBackend()


def test_a_resize_answers_what_it_did(resizable):
    with TestClient(create_app(resizable)) as client:
        grown = client.post("/v1/admin/scale", json={"data_parallel_size": 3})
        shrunk = client.post("/v1/admin/scale", json={"data_parallel_size": 1})
    assert grown.status_code == 200, grown.text
    assert grown.json() == {
        "status": "ok",
        "old_data_parallel_size": 2,
        "data_parallel_size": 3,
        "added_replicas": [2],
        "removed_replicas": [],
    }
    assert shrunk.json()["removed_replicas"] == [{"replica": 1, "reason": "least"}]
    assert resizable.calls == [3, 1]


@pytest.mark.parametrize("value", [0, -1, 2.5, "2", True, None])
def test_a_bad_size_is_a_400_naming_the_field_and_changes_nothing(resizable, value):
    with TestClient(create_app(resizable)) as client:
        response = client.post("/v1/admin/scale", json={"data_parallel_size": value})
    assert response.status_code == 400, response.text
    assert assert_openai_error(response.json())["param"] == "data_parallel_size"
    assert resizable.calls == [] and resizable.size == 2


def test_a_size_above_capacity_is_a_400_from_the_backend(resizable):
    with TestClient(create_app(resizable)) as client:
        response = client.post("/v1/admin/scale", json={"data_parallel_size": 9})
    assert response.status_code == 400
    error = assert_openai_error(response.json())
    assert error["param"] == "data_parallel_size" and "more than fits" in error["message"]
    assert resizable.size == 2


def test_a_misspelt_field_is_refused(resizable):
    with TestClient(create_app(resizable)) as client:
        response = client.post("/v1/admin/scale", json={"data_parallel_sise": 3})
    assert response.status_code == 400
    assert resizable.calls == []


def test_the_api_key_is_required(resizable):
    with TestClient(create_app(resizable, api_key="k")) as client:
        anonymous = client.post("/v1/admin/scale", json={"data_parallel_size": 3})
        keyed = client.post(
            "/v1/admin/scale",
            json={"data_parallel_size": 3},
            headers={"Authorization": "Bearer k"},
        )
    assert anonymous.status_code == 401
    assert keyed.status_code == 200
    assert resizable.calls == [3]


def test_the_in_process_replica_cannot_be_resized(client):
    response = client.post("/v1/admin/scale", json={"data_parallel_size": 2})
    assert response.status_code == 409
    error = assert_openai_error(response.json())
    assert error["code"] == "not_scalable" and "use_for_one_replica" in error["message"]
