"""The OpenAI-compatible HTTP app over any ``Backend`` (DESIGN sections 3, 7 and 10).

    POST /v1/completions        POST /v1/chat/completions       (JSON, or SSE with stream=true)
    POST /v1/responses          GET|DELETE /v1/responses/{id}   (OpenAI's Responses API, stored
                                per API key: ``cluster.api.responses``)
    GET  /v1/models             GET  /v1/models/{model}
    GET  /health                200 while a replica is alive, else 503 (never needs the key)
    GET  /metrics               Prometheus text (needs the key unless metrics_public)
    POST /v1/admin/reset_prefix_cache   forget every replica's unreferenced cached blocks of a
                                tier (``tier`` in the JSON body or the query: all, npu, host,
                                disk or another registered tier); also as vLLM's
                                ``POST /reset_prefix_cache`` and SGLang's
                                ``POST /flush_cache``, with the same key rule
    POST /v1/admin/scale        resize the deployment: {"data_parallel_size": N} (400 naming
                                data_parallel_size for a bad size, 409 for a deployment that
                                cannot be resized; both leave it as it was)

Every ``GET`` path answers ``HEAD`` too (``HeadAsGet``: the GET's status and headers, no body).

Request path: HeadAsGet -> APIKeyGuard (401) -> BodySizeLimit (413) -> route: parse the JSON
body (400) -> ``Serving`` checks and generates. Every error is OpenAI-shaped
(``cluster.api.errors``).
"""

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from cluster.api.errors import APIError, describe_validation_error, install_error_handlers
from cluster.api.middleware import APIKeyGuard, BodySizeLimit, HeadAsGet
from cluster.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    ResetPrefixCacheRequest,
    ScaleRequest,
    TokenizeRequest,
    ignored_fields,
)
from cluster.api.responses import (
    ResponsesAPI,
    ResponsesRequest,
    ResponseStore,
    ResponseStoreConfig,
)
from cluster.api.serving import Serving
from cluster.api.watchdog import LoopWatchdog
from cluster.backend import Backend, NotScalableError
from cluster.metrics import CONTENT_TYPE, StrataMetrics

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)

DEFAULT_MAX_REQUEST_BODY_BYTES = 2**20
RESET_PATHS = ("/v1/admin/reset_prefix_cache", "/reset_prefix_cache", "/flush_cache")


async def read_body(request: Request, model: type[B]) -> B:
    """The body as ``model``; a 400 saying what is wrong otherwise."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise APIError.bad_request(f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise APIError.bad_request(
            f"the request body must be a JSON object, got {type(data).__name__}"
        )
    try:  # JSON may escape a lone UTF-16 surrogate ("\ud800"), which no text can hold
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError.bad_request(
            "the request body holds an unpaired UTF-16 surrogate escape, which is not valid text"
        ) from None
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        raise describe_validation_error(error) from None
    ignored = ignored_fields(body)
    if ignored:
        logger.warning(
            "%s %s: ignoring fields this server does not know: %s",
            request.method,
            request.url.path,
            ", ".join(ignored),
        )
    return body


def create_app(
    backend: Backend,
    *,
    api_key: str | Sequence[str] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_tokens_limit: int | None = None,
    metrics_public: bool = True,
    watchdog_stall_s: float | None = 2.0,
    response_store: ResponseStoreConfig | None = None,
) -> FastAPI:
    """The HTTP app serving ``backend``. The caller owns the backend (and shuts it down).

    ``max_tokens_limit`` caps max_tokens (default: the backend's ``max_model_len``); with
    ``api_key`` set (one key or several), every path except /health (and /metrics when
    ``metrics_public``) needs ``Authorization: Bearer <key>``; stored responses belong to the
    key that created them. ``response_store``: bounds of the stored responses.
    ``watchdog_stall_s``: an event loop that does not answer for this long is logged with
    every thread's stack (``cluster.api.watchdog``); None turns the watchdog off."""
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be positive, got {max_request_body_bytes}")
    if max_tokens_limit is not None and max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be positive, got {max_tokens_limit}")
    metrics = StrataMetrics()
    serving = Serving(backend, metrics, max_tokens_limit or backend.max_model_len)
    watchdog = LoopWatchdog(watchdog_stall_s) if watchdog_stall_s is not None else None
    app = _app(backend, metrics, watchdog)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if api_key is not None:
        public_paths = {"/health", "/metrics"} if metrics_public else {"/health"}
        app.add_middleware(APIKeyGuard, api_keys=api_key, public_paths=public_paths)
    app.add_middleware(HeadAsGet)  # the outermost: every check sees the GET it stands for
    responses = ResponsesAPI(serving, ResponseStore(response_store or ResponseStoreConfig()))
    _add_generation_routes(app, serving, responses)
    _add_model_routes(app, backend, serving)
    _add_operation_routes(app, backend, metrics, watchdog)
    _add_reset_routes(app, backend)
    return app


def _app(backend: Backend, metrics: StrataMetrics, watchdog: LoopWatchdog | None) -> FastAPI:
    """The bare app: its state, error handlers and the watchdog's life with the event loop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if watchdog is not None:
            watchdog.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.stop()

    app = FastAPI(
        title="Strata", summary="OpenAI-compatible API of a Strata deployment", lifespan=lifespan
    )
    app.state.watchdog = watchdog
    app.state.backend = backend
    app.state.metrics = metrics
    install_error_handlers(app)
    return app


def _add_generation_routes(app: FastAPI, serving: Serving, responses: ResponsesAPI) -> None:
    """Completions, chat completions and the Responses API."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest)
        return await serving.respond(request, serving.completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest)
        return await serving.respond(request, serving.chat(body))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await read_body(request, ResponsesRequest)
        return await responses.create(request, body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return responses.retrieve(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return responses.delete(request, response_id)


def _add_model_routes(app: FastAPI, backend: Backend, serving: Serving) -> None:
    """The served model and its tokenizer: models, tokenizer info, tokenize, detokenize."""
    created = int(time.time())

    def model_card() -> ModelCard:
        return ModelCard(
            id=backend.model_name, created=created, max_model_len=backend.max_model_len
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        serving.check_model(model)
        return model_card()

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        info = {**backend.tokenizer.info(), "model_max_length": backend.max_model_len}
        return JSONResponse(info)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_body(request, TokenizeRequest)
        serving.check_model(body.model)
        tokens = backend.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": backend.max_model_len}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_body(request, DetokenizeRequest)
        serving.check_model(body.model)
        vocab_size = backend.tokenizer.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise APIError.bad_request(f"tokens must be ids below {vocab_size}", "tokens")
        return JSONResponse({"prompt": backend.tokenizer.decode(body.tokens)})


def _add_operation_routes(
    app: FastAPI, backend: Backend, metrics: StrataMetrics, watchdog: LoopWatchdog | None
) -> None:
    """What operators call: health, scaling and the Prometheus metrics."""

    @app.get("/health")
    async def health() -> JSONResponse:
        loop = {"event_loop": watchdog.health().as_dict()} if watchdog is not None else {}
        try:
            num_live = await backend.num_live_replicas()
        except Exception:
            logger.exception("health check: the backend did not answer")
            num_live = 0
        if num_live < 1:
            error = APIError(
                503, "no replica is alive", type="server_error", code="no_live_replica"
            )
            body = {"status": "unavailable", "live_replicas": 0, **loop, **error.body()}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "live_replicas": num_live, **loop})

    @app.post("/v1/admin/scale")
    async def scale(request: Request) -> JSONResponse:
        body = await read_body(request, ScaleRequest)
        try:
            result = await backend.scale(body.data_parallel_size)
        except ValueError as error:
            raise APIError.bad_request(str(error), "data_parallel_size") from None
        except NotScalableError as error:
            raise APIError(
                409, str(error), param="data_parallel_size", code="not_scalable"
            ) from None
        return JSONResponse({"status": "ok", **result.as_dict()})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            stats = await backend.stats()
        except Exception:
            logger.warning("metrics: the backend's stats are unavailable", exc_info=True)
            stats = None
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)


def _add_reset_routes(app: FastAPI, backend: Backend) -> None:
    """The prefix-cache reset, at Strata's path and at vLLM's and SGLang's."""

    async def reset_prefix_cache(request: Request) -> JSONResponse:
        query = dict(request.query_params)
        if await request.body():
            body = await read_body(request, ResetPrefixCacheRequest)
            if "tier" in query and query["tier"] != body.tier:
                raise APIError.bad_request("'tier' is given twice, differently", "tier")
        else:
            try:
                body = ResetPrefixCacheRequest.model_validate(query, strict=False)  # strings
            except ValidationError as error:
                raise describe_validation_error(error) from None
        if body.reset_running_requests:
            raise APIError.bad_request(
                "reset_running_requests is not served: blocks that running requests hold are "
                "kept; the reset forgets every other cached block",
                "reset_running_requests",
            )
        await backend.reset_prefix_cache(body.tier)
        return JSONResponse({"status": "ok", "tier": body.tier})

    # Strata's path, and vLLM's and SGLang's for the tools written against them (aiperf's
    # --reset-kv-cache, sglang's bench --flush-cache): one handler, one auth rule.
    for path in RESET_PATHS:
        app.post(path, name=f"reset_prefix_cache{path.replace('/', '_')}")(reset_prefix_cache)
