"""http-load: concurrent streaming clients over loopback against `strata serve`.

Starts ``strata serve tiny --dtype float32 --config configs/default.yaml`` (two replicas on an
embedded Ray) on a free loopback port, then runs ``clients`` concurrent clients for ``duration_s``:
each sends streaming completions one after another (a few shared system prompts plus a unique
question) and reads every SSE chunk. Reported: requests served and failed, throughput (requests and
tokens per second), TTFT (request sent to first chunk with text), inter-chunk latency and end-to-end
latency percentiles. The server is stopped with SIGINT at the end."""

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.report import Report, new_figure
from benchmarks.workload import median, percentile

NAME = "http-load"
ROOT = Path(__file__).resolve().parents[1]
PREFIXES = [
    "You are Strata's support assistant. Answer briefly and precisely. " * 3,
    "System: a conversation about prefix caches, KV blocks and routing. " * 3,
    "Context document: KV blocks move between the NPU tier and the host tier. " * 3,
]


@dataclass(frozen=True, slots=True)
class Settings:
    clients: int = 32
    duration_s: float = 45.0
    max_tokens: int = 16


QUICK = Settings(clients=4, duration_s=5.0, max_tokens=4)


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    port = free_port()
    log = output_dir / "serve.log"
    output_dir.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "serve",
                "tiny",  # the figures in benchmarks/README.md are on tiny in float32
                "--dtype",
                "float32",
                "--config",
                "configs/default.yaml",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server, log)
        stats = asyncio.run(_load(base, settings))
    finally:
        stop_server(server)
    report = Report(
        NAME,
        f"HTTP load: {settings.clients} streaming clients for "
        f"{settings.duration_s:g} s against strata serve (dp 2)",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        "Outcome and throughput",
        ["served", "errors", "requests/s", "tokens/s"],
        [[stats["served"], stats["errors"], stats["requests_per_s"], stats["tokens_per_s"]]],
    )
    report.add_table(
        "Latency (ms)",
        ["metric", "p50", "p90", "p99", "max"],
        [
            [name, *(1e3 * stats[name][q] for q in ("p50", "p90", "p99", "max"))]
            for name in ("ttft", "inter_chunk", "e2e")
        ],
    )
    figure, (axis,) = new_figure()
    for name in ("ttft", "e2e"):
        values = sorted(stats["samples"][name])
        axis.plot(
            [1e3 * v for v in values],
            [(i + 1) / len(values) for i in range(len(values))],
            label=name,
        )
    axis.set_xscale("log")
    axis.set_xlabel("ms (log)")
    axis.set_ylabel("fraction of requests")
    axis.legend()
    report.figures["latency_cdf.png"] = figure
    report.results = {
        "settings": asdict(settings),
        **{k: v for k, v in stats.items() if k != "samples"},
    }
    return report.write(output_dir)


async def _load(base: str, settings: Settings) -> dict:
    samples: dict[str, list[float]] = {"ttft": [], "inter_chunk": [], "e2e": []}
    counts = {"served": 0, "errors": 0, "tokens": 0}
    deadline = time.monotonic() + settings.duration_s

    async def client(index: int) -> None:
        rng = random.Random(index)
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            for n in range(10_000):
                if time.monotonic() >= deadline:
                    return
                body = {
                    "model": "tiny",
                    "prompt": rng.choice(PREFIXES) + f"Question {index}.{n}?",
                    "max_tokens": settings.max_tokens,
                    "stream": True,
                    "ignore_eos": True,
                }
                try:
                    await _one(http, body, samples, counts)
                except (httpx.HTTPError, ValueError):
                    counts["errors"] += 1

    start = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(settings.clients)))
    elapsed = time.monotonic() - start
    summary = {
        name: {"p50": median(v), "p90": percentile(v, 90), "p99": percentile(v, 99), "max": max(v)}
        for name, v in samples.items()
        if v
    }
    return {
        "served": counts["served"],
        "errors": counts["errors"],
        "requests_per_s": counts["served"] / elapsed,
        "tokens_per_s": counts["tokens"] / elapsed,
        **summary,
        "samples": samples,
    }


async def _one(http: httpx.AsyncClient, body: dict, samples: dict, counts: dict) -> None:
    sent = time.monotonic()
    first = last = None
    done = False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise ValueError(f"status {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            now = time.monotonic()
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                counts["tokens"] += 1
                if first is None:
                    first = now
                else:
                    samples["inter_chunk"].append(now - last)
                last = now
    if not done or first is None:
        raise ValueError("stream ended without [DONE] or text")
    samples["ttft"].append(first - sent)
    samples["e2e"].append(time.monotonic() - sent)
    counts["served"] += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(server: subprocess.Popen) -> None:
    """Stop ``strata serve`` as Ctrl-C would (SIGINT); kill its process group if it hangs."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def wait_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"strata serve exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("strata serve did not become healthy within 180 s")
