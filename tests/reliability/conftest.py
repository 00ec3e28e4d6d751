"""Shared pieces of the reliability tests: the session's one Ray instance, a uvicorn server on
127.0.0.1 in a thread, the OpenAI error shape, and bounded waiting.

Every loop here is bounded in count and time; no test asserts a timing.
"""

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import ActorUnavailableError

from cluster.config import ServerConfig
from tests.integration.conftest import ray_session  # noqa: F401  (the one shared Ray fixture)

ROOT = Path(__file__).resolve().parents[2]


class UvicornThread:
    """Serves an ASGI app on a free loopback port from a daemon thread, until ``close``."""

    def __init__(self, app, limit_concurrency: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            limit_concurrency=limit_concurrency,
            timeout_graceful_shutdown=5,
            # As ``strata serve`` (``ServerConfig.keep_alive_s``): idle connections outlive the
            # clients' own expiry (httpx: 5 s, uvicorn's default too).
            timeout_keep_alive=ServerConfig().keep_alive_s,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        wait_for(lambda: self.server.started, "uvicorn to start", timeout_s=30)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def wait_for(
    condition: Callable[[], object], what: str, timeout_s: float = 60, interval_s: float = 0.1
) -> object:
    """Poll ``condition`` until it is truthy (bounded); fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / interval_s) + 1):
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def figures(name: str, **values: object) -> None:
    """Print the test's one ``FIGURES <name> {...}`` line (RELIABILITY.md quotes them)."""
    print(f"\nFIGURES {name} {json.dumps(values, sort_keys=True)}", flush=True)


def assert_openai_error(body: object) -> dict:
    """``body`` is exactly ``{"error": {"message", "type", "param", "code"}}``."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body
    return error


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``url``/metrics, keyed by (name, labels)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=60).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_sum(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """The sum of ``name`` over every sample whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process on this machine (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


CLEAN = {"npu_blocks_used": 0, "host_blocks_used": 0, "num_unfinished": 0}


def wait_until_clean(backend: Any, timeout_s: float = 60) -> list[dict[str, int]]:
    """Every replica's integrity check passes with no block in use and nothing unfinished
    (bounded polling: aborts land at the next gap between engine steps). A replica that Ray is
    restarting (killed just before, and the health monitor has not noticed yet) is waited for."""

    def clean() -> list[dict[str, int]] | None:
        try:
            reports = asyncio.run(backend.check_integrity())  # raises if a check fails
        except ActorUnavailableError:  # restarting: it comes back empty
            return None
        return reports if all(report == CLEAN for report in reports) else None

    try:
        return wait_for(clean, "every replica to be clean", timeout_s, interval_s=0.25)
    except AssertionError as error:
        raise AssertionError(f"{error}: {asyncio.run(backend.check_integrity())}") from None


@contextmanager
def serve_on_ray(config: Any, name: str) -> Iterator[tuple[UvicornThread, Any]]:
    """``strata serve``'s app (``cluster.server.build_app``) over a Ray deployment on the
    session's Ray instance, served by uvicorn on 127.0.0.1."""
    from cluster.server import build_app

    app, backend = build_app(config, name=name)
    try:
        server = UvicornThread(app)
    except BaseException:
        backend.shutdown()
        raise
    try:
        yield server, backend
    finally:
        server.close()
        backend.shutdown()
