"""``strata serve``: deploy on Ray and serve the OpenAI-compatible HTTP API until stopped, then
stop everything it started."""

import asyncio
import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import uvicorn

from cluster.config import ClusterConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from cluster.deploy import RayBackend

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 4.0
"""How long requests in flight may run on after a stop was asked for."""
STOP_GRACE_S = 2.0
"""How long an embedded Ray's processes have to exit on SIGTERM before they are killed: with
the graceful shutdown, ``strata serve`` ends within 10 s of a signal."""


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
    """Serve until interrupted (Ctrl-C or SIGTERM, to this process or its process group), then
    stop. With ``reload`` (re-reads the config file), SIGHUP applies a changed size
    (``cluster.reload``).

    On a Ray cluster this process joined, stopping kills this deployment's actors through Ray.
    An embedded Ray (started here, no address) is this process's own: its processes are stopped
    directly (``stop_local_processes``) and this process then ends at once. A signal to the
    process group (a terminal's Ctrl-C, ``kill -TERM -PGID``, a supervisor) reaches Ray's GCS
    and raylet too, and they exit; any call through Ray would then wait a minute for the GCS
    (Ray's reconnect timeout), and so would Ray's own clean-up at interpreter exit."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from cluster.placement import is_embedded

    if not is_embedded(config.ray):
        _serve(config, reload, release=True)
        return
    adopt_orphans()
    status = 0
    try:
        _serve(config, reload, release=False)
    except SystemExit as exit_:  # a start-up failure, or SIGTERM while deploying
        status = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    for sig in (signal.SIGINT, signal.SIGTERM):  # the stop is bounded: a second signal waits
        signal.signal(sig, signal.SIG_IGN)
    stop_local_processes()
    print("strata: stopped", flush=True)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(status)


def _serve(
    config: ClusterConfig, reload: Callable[[], ClusterConfig] | None, *, release: bool
) -> None:
    """Deploy, serve until a signal stops uvicorn; ``release``: then kill the deployment's
    actors through Ray."""
    from cluster.deploy import ReplicaStartError

    try:
        app, backend = build_app(config)
    except (MemoryError, ReplicaStartError) as error:  # one sentence, not a traceback
        print(f"strata: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2 if isinstance(error, MemoryError) else 1) from None
    # ray.init made SIGTERM exit with status 15; it asks for a stop, as Ctrl-C does (uvicorn
    # handles both while it serves, then raises the signal it got again).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = config.server
    uvicorn_server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=server.host,
            port=server.port,
            log_level="info",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
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
        pass  # uvicorn already shut down gracefully; the signal is raised again after it
    finally:
        if release:
            backend.shutdown()
            print("strata: stopped", flush=True)


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def adopt_orphans() -> None:
    """Makes this process the parent of any process it started, however deep, whose own parent
    exits first (Linux's child subreaper): a signal to the process group ends the raylet at
    once, and its actors' workers, still exiting, would otherwise pass to init, out of
    ``stop_local_processes``'s reach. A no-op where the kernel has no such call."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def stop_local_processes(grace_s: float = STOP_GRACE_S) -> None:
    """Stops every process this one started, and theirs (an embedded Ray: GCS, raylet, their
    agents and the actors' workers, kept as children by ``adopt_orphans`` when their parent
    exited first): SIGTERM to all at once, SIGKILL to those still running after ``grace_s``,
    and every one reaped. Twice, in case a worker was started meanwhile."""
    import psutil

    for _ in range(2):
        processes = psutil.Process().children(recursive=True)
        if not processes:
            return
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()
        _, alive = psutil.wait_procs(processes, timeout=grace_s)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(alive, timeout=1.0)
