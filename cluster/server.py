"""``strata serve``: deploy on Ray and serve the OpenAI-compatible HTTP API until stopped."""

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable
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
    if config.scaling is not None:
        _run_autoscaler(app, backend, config)
    return app, backend


def _run_autoscaler(app: "FastAPI", backend: "RayBackend", config: ClusterConfig) -> None:
    """Run the autoscaling policy (``cluster.autoscale``) for as long as the app serves; its
    decisions go to the app's /metrics."""
    from cluster.autoscale import Autoscaler

    metrics = app.state.metrics
    autoscaler = Autoscaler(
        config.scaling,
        config.scheduler.max_num_seqs,
        on_decision=lambda d: metrics.record_autoscale(d.direction, d.num_replicas),
    )
    serving_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: "FastAPI") -> AsyncIterator[None]:
        async with serving_lifespan(app):
            task = asyncio.create_task(autoscaler.run(backend))
            try:
                yield
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    app.router.lifespan_context = lifespan


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (``uvicorn[standard]`` brings it on Linux and
    macOS), else asyncio's: the front writes one SSE chunk per token per request, and uvloop's
    transports and scheduling cost a fraction of asyncio's pure-Python ones."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(config: ClusterConfig, reload: Callable[[], ClusterConfig] | None = None) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM), then shut every actor down. With
    ``reload`` (re-reads the config file), SIGHUP applies a changed size (``cluster.reload``)."""
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
            app,
            host=server.host,
            port=server.port,
            log_level="info",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=server.keep_alive_s,
        )
    )
    print(
        f"strata: serving {config.served_model_name} with {config.data_parallel_size} "
        f"replica(s) on http://{server.host}:{server.port}/v1",
        flush=True,
    )

    async def run() -> None:
        if reload is not None:
            from cluster.reload import watch_sighup

            watch_sighup(asyncio.get_running_loop(), backend, config, reload)
        await uvicorn_server.serve()

    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(run())
    except KeyboardInterrupt:
        pass  # uvicorn already shut down gracefully; re-raised by asyncio.run on SIGINT
    finally:
        backend.shutdown()
        print("strata: stopped", flush=True)
