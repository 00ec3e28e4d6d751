"""Server-sent events, and waiting that stops when the client goes away.

A request holds KV blocks on a replica until it finishes or is aborted, so the app never keeps
generating for a client that has disconnected. It watches the connection itself (the ASGI
``http.disconnect`` message) rather than relying on the server noticing a failed write:

    handler:   parse --> until_disconnected(first output) --> EventStreamResponse(events)
    response:  until_disconnected(send every event) --> finally events.aclose()

Closing the events generator closes the backend's output iterator, which aborts the request.
"""

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was complete."""


def sse(payload: BaseModel | dict) -> bytes:
    """One ``data:`` event holding ``payload`` as JSON."""
    if isinstance(payload, BaseModel):
        return b"data: " + payload.model_dump_json().encode() + b"\n\n"
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(receive: Receive, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client disconnects first, cancel it (and wait until it has
    unwound, so that the request is aborted) and raise ``ClientDisconnected``.

    The request body must have been read already: the watcher consumes ASGI messages."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = [task for task in (work, watcher) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)  # let the work unwind: its request is aborted by then
        if watcher.done() and not watcher.cancelled():
            watcher.exception()  # a receive() that failed counts as a disconnect
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` that stops sending when the client disconnects, then closes its
    events generator and ``close_also`` (the backend's stream, which may never have been
    reached if the events never started)."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], close_also: AsyncGenerator | None = None
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._closing = [events] if close_also is None else [events, close_also]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnected(receive, self.stream_response(send))
        except (ClientDisconnected, OSError):
            pass  # nobody is listening; the request is released below
        finally:
            for generator in self._closing:
                await generator.aclose()
