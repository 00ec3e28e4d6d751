"""Calls to the router actor from one process, coalesced: the requests that ask for a route, or
release one, in the same turn of the event loop go to the router as one call of its list form
(``route_many``, ``release_many``). A burst of N arrivals costs one round trip, not N."""

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import Any

from replicas.kv.hashing import BlockHash
from router.policies import RouteDecision


class _Coalescer:
    """Items added during one turn of the event loop, sent as one list to ``send`` (which
    returns an awaitable of one result per item, or of None); each item's future gets its
    result, or the call's error. A result that is an exception is raised to that item alone."""

    def __init__(self, send: Callable[[list[Any]], Any], *, best_effort: bool = False) -> None:
        self._send = send
        self.num_calls = 0
        self._best_effort = best_effort  # a failed call resolves its items' futures with None
        self._items: list[Any] = []
        self._futures: list[asyncio.Future] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: set[asyncio.Task] = set()  # in flight (the loop keeps weak references)

    def add(self, item: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # items of a loop that ended before its flush are lost
            self._items, self._futures, self._loop = [], [], loop
        if not self._items:
            loop.call_soon(self._flush)
        future = loop.create_future()
        self._items.append(item)
        self._futures.append(future)
        return future

    def _flush(self) -> None:
        items, futures = self._items, self._futures
        self._items, self._futures = [], []
        if items:
            call = asyncio.ensure_future(self._call(items, futures))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _call(self, items: list[Any], futures: list[asyncio.Future]) -> None:
        self.num_calls += 1
        try:
            results = await self._send(items)
        except Exception as error:  # the call failed: every item of it did
            for future in futures:
                if future.done():
                    continue
                if self._best_effort:
                    future.set_result(None)
                else:
                    future.set_exception(error)
            return
        for index, future in enumerate(futures):
            result = results[index] if results is not None else None
            if future.done():  # its caller gave up waiting
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


class RouterCalls:
    """``route`` and ``release`` on a ``RouterActor``, coalesced per event-loop turn."""

    def __init__(self, router: Any) -> None:
        self._routes = _Coalescer(router.route_many.remote)
        self._releases = _Coalescer(router.release_many.remote, best_effort=True)

    @property
    def num_route_calls(self) -> int:
        return self._routes.num_calls

    def route(
        self,
        request_id: str,
        num_prompt_tokens: int,
        block_hashes: Sequence[BlockHash],
        exclude: Collection[int] = (),
        cache_key: str | None = None,
    ) -> "asyncio.Future[RouteDecision]":
        """The router's decision; raises what ``Router.route`` raised for this request."""
        return self._routes.add(
            (request_id, num_prompt_tokens, block_hashes, sorted(exclude), cache_key)
        )

    def release(self, request_id: str) -> asyncio.Future:
        """Done once the router has released the request (idempotent on its side), or failed
        to: a release is best effort (a restarted router starts with no charges)."""
        return self._releases.add(request_id)
