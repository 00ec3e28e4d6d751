"""``RayBackend`` routing while the router is behind the deployment, over in-process replicas (no
Ray). Ray re-creates a killed router at its start-up size, every start-up replica serving and
live, and the health monitor tells it the deployment's replicas only at its next ping: until
then it names a replica the deployment retired or knows lost. The request is asked again of the
router until it catches up, runs on the replica that stays and never calls the other; a router
that stays behind past ``ROUTER_CATCH_UP_S`` still ends the request as before."""

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError

import cluster.dispatch as dispatch
from cluster.backend import OverloadedError, ReplicaFailedError
from replicas.sampling_params import SamplingParams
from tests.unit.test_resume_backend import CutReplica, collect, in_process_backend

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
TOLD_AFTER_S = 0.5
"""When the stand-in health monitor tells the restarted router the replicas."""


class GoneReplica:
    """A replica actor that is gone (killed by a scale-in, or lost): every call fails."""

    def __init__(self) -> None:
        self.num_submits = 0
        self.submit = SimpleNamespace(remote=self._submit)
        self.abort = SimpleNamespace(remote=lambda request_id: None)
        self.outputs = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=self._stream))

    def number(self, index: int) -> "GoneReplica":
        return self

    async def _submit(self, *args) -> None:
        self.num_submits += 1
        raise ActorDiedError()

    async def _stream(self, subscriber: str):
        raise ActorDiedError()
        yield


class RestartedRouter:
    """Names replica 0, which it believes serving, until ``told``; then the lowest replica the
    health monitor calls live and the request does not exclude."""

    def __init__(self, health) -> None:
        self.health = health
        self.told = False
        self.answers: list[int] = []

    def route(self, request_id, num_prompt_tokens, hashes, exclude=(), cache_key=None):
        index = min(self.health.live - set(exclude)) if self.told else 0
        self.answers.append(index)
        future = asyncio.get_running_loop().create_future()
        future.set_result(SimpleNamespace(replica_index=index, peer_source=None))
        return future

    def release(self, request_id):
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def behind(role: str):
    """A deployment whose replica 0 is gone (``role``: retired by a scale-in, or lost) and whose
    replica 1 serves, behind a restarted router that still names 0."""
    gone = GoneReplica()
    backend = in_process_backend([gone, CutReplica()])
    if role == "retired":
        backend.membership.retire(0)
    backend.health.live.discard(0)
    router = backend.dispatcher.router_calls = RestartedRouter(backend.health)
    return backend, router, gone


async def told_later(backend, router: RestartedRouter, request_id: str) -> list:
    async def tell() -> None:
        await asyncio.sleep(TOLD_AFTER_S)
        router.told = True

    telling = asyncio.ensure_future(tell())
    try:
        return await collect(backend, request_id, PARAMS)
    finally:
        telling.cancel()


@pytest.mark.parametrize("role", ["retired", "lost"])
def test_a_request_waits_for_a_restarted_router_to_be_told_the_replicas(role):
    backend, router, gone = behind(role)
    outputs = asyncio.run(asyncio.wait_for(told_later(backend, router, "r"), 60))
    final = outputs[-1]
    assert final.finished and len(final.token_ids) == PARAMS.max_tokens
    assert {o.replica_index for o in outputs} == {1}
    assert gone.num_submits == 0
    assert router.answers[0] == 0 and router.answers[-1] == 1
    assert backend.dispatcher.counts.num_rerouted == 0


@pytest.mark.parametrize(
    ("role", "error", "message"),
    [
        ("retired", OverloadedError, r"^replicas \[\] turned the request away"),
        ("lost", ReplicaFailedError, r"^replica 0 failed while serving the request"),
    ],
)
def test_a_router_that_stays_behind_ends_the_request_as_before(monkeypatch, role, error, message):
    monkeypatch.setattr(dispatch, "ROUTER_CATCH_UP_S", 0.2)
    backend, router, gone = behind(role)
    with pytest.raises(error, match=message):
        asyncio.run(asyncio.wait_for(collect(backend, "r", PARAMS), 60))
    # Bounded: within the catch-up time the waits (10 ms and up) allow at most 2 + 0.2 / 0.01
    # answers, and past it each of the run's attempts takes one more.
    assert len(router.answers) <= 2 + 20 + 2 * max(2, backend.membership.num_members())
    assert set(router.answers) == {0}
    # A retired replica is never called; a lost one only by the last attempt (the health
    # monitor may be wrong about it).
    assert gone.num_submits == (1 if role == "lost" else 0)
