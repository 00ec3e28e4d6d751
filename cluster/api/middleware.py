"""What runs before any route: ``HEAD`` answered as ``GET``, then the checks: the API key
(401), then the body size (413).

All are plain ASGI middleware, so they never buffer a streaming response and answer in the
OpenAI error shape without reaching the app.
"""

import hashlib
import secrets
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.api.errors import APIError

API_KEY_ID = "api_key_id"  # the ASGI scope state entry naming the key a request used


def key_id(api_key: str) -> str:
    """A name for a key that does not reveal it: what logs and per-key state may hold."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def api_key_id(scope: Scope) -> str | None:
    """The ``key_id`` of the key the request was let in with; None when no key is required."""
    return scope.get("state", {}).get(API_KEY_ID)


class APIKeyGuard:
    """Requires ``Authorization: Bearer <key>``, with any of ``api_keys``, on every path but
    ``public_paths``, and records which key it was in the scope's state (``api_key_id``):
    state kept per key (stored responses) is partitioned by it."""

    def __init__(
        self, app: ASGIApp, api_keys: str | Collection[str], public_paths: Collection[str]
    ) -> None:
        if isinstance(api_keys, str):
            api_keys = [api_keys]
        if not api_keys:
            raise ValueError("APIKeyGuard needs at least one key")
        self.app = app
        self._expected = [(f"Bearer {key}".encode(), key_id(key)) for key in api_keys]
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None:
            # Every key is compared, so that the time taken does not tell which one matched.
            matches = [i for e, i in self._expected if secrets.compare_digest(given, e)]
            if matches:
                scope.setdefault("state", {})[API_KEY_ID] = matches[0]
                await self.app(scope, receive, send)
                return
        message = (
            "Missing API key: send it as 'Authorization: Bearer <key>'"
            if given is None
            else "Incorrect API key provided"
        )
        error = APIError(
            401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await error.response()(scope, receive, send)


class BodySizeLimit:
    """Reads the whole request body (at most ``max_bytes``) before the app runs, answering 413
    when it is larger; the app then reads it from memory."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        messages: list[Message] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its whole body: nobody to answer
            messages.append(message)
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"the request body is larger than this server accepts ({self.max_bytes} bytes)",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)


class HeadAsGet:
    """Answers ``HEAD`` on every path as ``GET`` would, status and headers (``content-length``
    included) without the body (RFC 9110, 9.3.2): FastAPI routes declared with ``GET`` answer
    only that method. A path without a ``GET`` still answers 405, with its ``Allow``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_head(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # the body's pieces are not sent; its end is, empty
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_head)
