"""Every error the HTTP API returns, in OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

Client mistakes are 4xx with a message that says what to change; the server keeps serving after
any of them. Only unexpected server faults are 500, with a generic message (the cause is logged).
"""

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.backend import NoLiveReplicaError, OverloadedError, ReplicaFailedError

logger = logging.getLogger(__name__)

_RETRY_AFTER = {"Retry-After": "1"}


class APIError(Exception):
    """An error answered to the client as it is."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> "APIError":
        return cls(400, message, param=param)

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> Response:
        # ASCII-escaped, so that no text echoed from a request can make the answer unencodable.
        content = json.dumps(self.body(), ensure_ascii=True).encode()
        return Response(
            content, self.status_code, headers=self.headers, media_type="application/json"
        )


def from_backend_error(error: Exception) -> APIError | None:
    """The answer to a backend's documented failure; None for anything else (a server fault)."""
    if isinstance(error, OverloadedError):
        return APIError(
            429, str(error), type="rate_limit_error", code="overloaded", headers=_RETRY_AFTER
        )
    if isinstance(error, NoLiveReplicaError):
        return APIError(
            503, str(error), type="server_error", code="no_live_replica", headers=_RETRY_AFTER
        )
    if isinstance(error, ReplicaFailedError):
        return APIError(503, str(error), type="server_error", code="replica_failed")
    return None


def internal_error() -> APIError:
    return APIError(
        500, "the server had an internal error; see its log", type="server_error", code=None
    )


def describe_validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first bad field. Fields that accept several shapes (``prompt``,
    ``stop``, message ``content``) check them in their own validators, whose sentences are
    passed on as they are."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"] if part != "body"]
    field = loc[0] if loc else None
    if first["type"] == "extra_forbidden":
        name = ".".join(loc)
        return APIError.bad_request(f"Unrecognized request argument supplied: {name}", field)
    if first["type"] == "value_error":
        return APIError.bad_request(str(first["ctx"]["error"]), field)
    where = ".".join(loc) or "the request body"
    return APIError.bad_request(f"invalid value for '{where}': {first['msg']}", field)


def install_error_handlers(app: FastAPI) -> None:
    """Turn every exception that reaches FastAPI into an OpenAI-shaped answer."""

    async def on_api_error(request: Request, error: APIError) -> Response:
        return error.response()

    async def on_http_error(request: Request, error: StarletteHTTPException) -> Response:
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = str(error.detail)
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        api_error = APIError(
            error.status_code,
            message,
            code=codes.get(error.status_code),
            headers=dict(error.headers or {}),
        )
        return api_error.response()

    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        return describe_validation_error(error).response()

    async def on_backend_error(request: Request, error: Exception) -> Response:
        api_error = from_backend_error(error)
        assert api_error is not None
        return api_error.response()

    async def on_unexpected(request: Request, error: Exception) -> Response:
        logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=error)
        return internal_error().response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    for backend_error in (NoLiveReplicaError, OverloadedError, ReplicaFailedError):
        app.add_exception_handler(backend_error, on_backend_error)
    app.add_exception_handler(Exception, on_unexpected)
