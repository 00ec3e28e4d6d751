"""``strata serve``: deploy on Ray and serve the OpenAI-compatible HTTP API until stopped."""

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from cluster.config import ClusterConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from cluster.deploy import RayBackend

logger = logging.getLogger(__name__)


def build_app(config: ClusterConfig, name: str = "strata") -> tuple["FastAPI", "RayBackend"]:
    """The HTTP app over a fresh Ray deployment of ``config`` (actors named ``name-*``)."""
    from cluster.api.app import create_app
    from cluster.deploy import RayBackend

    backend = RayBackend(config, name=name)
    server = config.server
    app = create_app(
        backend,
        api_key=server.api_key,
        max_request_body_bytes=server.max_request_body_bytes,
        max_tokens_limit=server.max_tokens_limit,
        metrics_public=server.metrics_public,
        watchdog_stall_s=server.watchdog_stall_s,
        response_store=server.responses,
    )
    return app, backend


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (``uvicorn[standard]`` brings it on Linux and
    macOS), else asyncio's: the front writes one SSE chunk per token per request, and uvloop's
    transports and scheduling cost a fraction of asyncio's pure-Python ones."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(config: ClusterConfig) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM), then shut every actor down."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from cluster.deploy import ReplicaStartError

    try:
        app, backend = build_app(config)
    except (MemoryError, ReplicaStartError) as error:  # one sentence, not a traceback
        print(f"strata: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2 if isinstance(error, MemoryError) else 1) from None
    server = config.server
    uvicorn_server = uvicorn.Server(
        uvicorn.Config(
            app, host=server.host, port=server.port, log_level="info", timeout_graceful_shutdown=5
        )
    )
    print(
        f"strata: serving {config.served_model_name} with {config.data_parallel_size} "
        f"replica(s) on http://{server.host}:{server.port}/v1",
        flush=True,
    )
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(uvicorn_server.serve())
    except KeyboardInterrupt:
        pass  # uvicorn already shut down gracefully; re-raised by asyncio.run on SIGINT
    finally:
        backend.shutdown()
        print("strata: stopped", flush=True)
