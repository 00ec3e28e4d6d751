"""Router calls from one process are coalesced per event-loop turn, each caller getting its own
answer or error."""

import asyncio
from types import SimpleNamespace

import pytest

from cluster.router_calls import RouterCalls
from router.router import NoLiveReplicaError


class FakeRouter:
    """``route_many`` / ``release_many`` as a Ray actor handle exposes them (``.remote``)."""

    def __init__(self, fail: bool = False) -> None:
        self.route_calls: list[list] = []
        self.release_calls: list[list] = []
        self.fail = fail
        self.route_many = SimpleNamespace(remote=self._route_many)
        self.release_many = SimpleNamespace(remote=self._release_many)

    async def _route_many(self, requests):
        self.route_calls.append(list(requests))
        if self.fail:
            raise ConnectionError("router gone")
        return [
            NoLiveReplicaError("none")
            if rid == "nobody"
            else SimpleNamespace(replica_index=n % 3, peer_source=None)
            for rid, n, *_ in requests
        ]

    async def _release_many(self, request_ids):
        self.release_calls.append(list(request_ids))
        if self.fail:
            raise ConnectionError("router gone")


def test_requests_of_one_turn_share_one_call_and_get_their_own_answers():
    router = FakeRouter()

    async def scenario():
        calls = RouterCalls(router)
        burst = [calls.route(f"r{n}", n, [], {2, 1}) for n in range(10)]
        nobody = calls.route("nobody", 1, [])
        answers = await asyncio.gather(*burst)
        with pytest.raises(NoLiveReplicaError):
            await nobody
        later = await calls.route("r11", 11, [])  # a later turn: a call of its own
        await asyncio.gather(calls.release("r1"), calls.release("r2"))
        return answers, later

    answers, later = asyncio.run(scenario())
    assert [a.replica_index for a in answers] == [n % 3 for n in range(10)]
    assert later.replica_index == 11 % 3
    assert [len(call) for call in router.route_calls] == [11, 1]
    assert router.route_calls[0][0] == ("r0", 0, [], [1, 2], None)  # exclude sent sorted
    assert router.release_calls == [["r1", "r2"]]


def test_a_failed_call_fails_its_routes_and_completes_its_releases():
    router = FakeRouter(fail=True)

    async def scenario():
        calls = RouterCalls(router)
        routes = [calls.route(f"r{n}", n, []) for n in range(3)]
        results = await asyncio.gather(*routes, return_exceptions=True)
        released = await calls.release("r0")  # best effort: done, not raised
        return results, released

    results, released = asyncio.run(scenario())
    assert all(isinstance(r, ConnectionError) for r in results)
    assert released is None and router.release_calls == [["r0"]]


def test_a_new_event_loop_starts_afresh():
    router = FakeRouter()
    calls = RouterCalls(router)

    async def route(request_id: str, num_tokens: int):
        return await calls.route(request_id, num_tokens, [])

    first = asyncio.run(route("a", 1))
    second = asyncio.run(route("b", 2))
    assert (first.replica_index, second.replica_index) == (1, 2)
