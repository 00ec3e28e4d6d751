"""A soak on the real model: SmolLM2-135M on two Ray replicas with the host tier, under a mixed
load, with a replica killed every few minutes.

The load is chat and completions, streaming and not, over shared system prompts: greedy
requests from a fixed set whose outputs are compared with a reference run of the same prompts
(sent one at a time before the load), sampled requests, and streams the client hangs up on
after the first events. Every ``kill_every_s`` replica 0 is killed (Ray restarts it); replica 1,
the router and the HTTP front live through the whole run, and their resident memory is sampled
every few seconds.

The run asserts (``SoakReport.failures`` names what failed):

* every request completed (or was answered with a clear 429/503 back-pressure error);
* every greedy output equals the reference run's;
* every replica is clean afterwards (no block in use, nothing unfinished);
* the resident memory of every process that lived through the run (HTTP front, router,
  replica 1), less the shared pages of Ray's object store, is within 5% between the second and
  the last quarter of the run.

The CI round (``tests/reliability/test_soak.py``) is short; the documented run is 30 minutes::

    python -m tests.reliability.soak --minutes 30

``SoakReport`` is also printed as one ``FIGURES soak {...}`` line for RELIABILITY.md. The HTTP
front runs in this process (uvicorn in a thread, as ``strata serve`` serves it), so its
resident memory includes the load's clients.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import ray

from cluster.config import ClusterConfig
from tests.reliability.conftest import (
    figures,
    serve_on_ray,
    wait_for,
    wait_until_clean,
)
from tests.reliability.traffic import REQUEST_TIMEOUT_S, client_pool

SYSTEM_PROMPTS = [
    "You are a librarian at a small town library. You answer questions about books, reading "
    "habits and the care of old volumes in two short sentences, and you never invent titles. ",
    "You are a support assistant for a tiered key-value cache. Blocks move between the "
    "accelerator, host memory and a shared disk; explain each answer plainly and briefly. ",
    "You are a cooking teacher. Answer with one practical tip a beginner can try tonight, "
    "name the ingredients, and keep the answer under forty words. ",
]
QUESTIONS = [
    "What should I read next?",
    "Why does a cache evict blocks?",
    "How do I keep bread fresh?",
    "What is a good first step?",
    "Can you explain it again?",
    "What would you avoid?",
]
GREEDY_MAX_TOKENS = 12
SAMPLED_MAX_TOKENS = (4, 24)
RSS_TOLERANCE = 0.05
RESTART_TIMEOUT_S = 180.0
RSS_SAMPLE_S = 2.0


def soak_config() -> ClusterConfig:
    """SmolLM2 on two replicas with a small NPU tier, so the host tier serves reloads."""
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            # Greedy outputs may be compared across batches only where the arithmetic is
            # batch-invariant: float32 with the weights dequantized is; torch's packed int4
            # product is not (a prompt decoded beside longer requests changed its greedy tokens
            # on a Zen 4 EPYC), so ``auto`` could pick a configuration no reference run matches.
            "model": {
                "model": "smollm2-135m",
                "dtype": "float32",
                "quantization": "none",
                "num_npu_blocks": 96,
            },
            "scheduler": {
                "max_num_seqs": 8,
                "kv_offload_config": {"enabled": True, "host_memory_ratio": 2.0},
            },
            "server": {"max_tokens_limit": 64},
            "ray": {"cpus_per_replica": 0.5},
        }
    )


@dataclass(frozen=True)
class Prompt:
    system: str
    question: str
    chat: bool

    def body(self, *, stream: bool, max_tokens: int, temperature: float) -> dict:
        body: dict = {"max_tokens": max_tokens, "temperature": temperature, "stream": stream}
        if self.chat:
            body["messages"] = [
                {"role": "system", "content": self.system},
                {"role": "user", "content": self.question},
            ]
        else:
            body["prompt"] = f"{self.system}\nQuestion: {self.question}\nAnswer:"
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def greedy_prompts() -> list[Prompt]:
    """The fixed set whose greedy outputs are checked: every system prompt, chat and not."""
    return [
        Prompt(system, QUESTIONS[(i + j) % len(QUESTIONS)], chat)
        for i, system in enumerate(SYSTEM_PROMPTS)
        for j, chat in enumerate((True, False))
    ]


@dataclass
class SoakReport:
    duration_s: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)
    greedy_checked: int = 0
    kills: int = 0
    resumed: float = 0.0
    rss_mib: dict[str, list[float]] = field(default_factory=dict)
    """Mean resident MiB of each long-lived process in the second and the last quarter."""
    failures: list[str] = field(default_factory=list)


async def _exchange(client: httpx.AsyncClient, body: dict, hang_up: bool = False) -> dict:
    """One request: its text, finish reason and usage (or ``status``/``error``)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:
        response = await client.post(path, json=body, timeout=REQUEST_TIMEOUT_S)
        if response.status_code != 200:
            return {"status": response.status_code, "error": response.text[:300]}
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {"status": 200, "text": text, "finish": choice["finish_reason"]}
    parts, finish, events = [], None, 0
    async with client.stream("POST", path, json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "error": (await response.aread())[:300]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line.removeprefix("data: "))
            if "error" in payload:
                return {"status": 200, "error": payload["error"]}
            for choice in payload.get("choices", []):
                delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                parts.append(delta)
                finish = choice.get("finish_reason") or finish
            events += 1
            if hang_up and events >= 2:
                return {"status": 200, "hung_up": True}
    return {"status": 200, "text": "".join(parts), "finish": finish}


async def reference_outputs(url: str, prompts: list[Prompt]) -> dict[Prompt, str]:
    """Each greedy prompt alone, before the load."""
    async with client_pool(url, 1) as client:
        outputs = {}
        for prompt in prompts:
            body = prompt.body(stream=False, max_tokens=GREEDY_MAX_TOKENS, temperature=0.0)
            answer = await _exchange(client, body)
            assert answer["status"] == 200 and "text" in answer, answer
            outputs[prompt] = answer["text"]
        return outputs


BACK_PRESSURE = {(429, "overloaded"), (503, "no_live_replica")}


def _error_code(answer: dict) -> str | None:
    error = answer.get("error")
    if isinstance(error, (str, bytes)):
        try:
            error = json.loads(error)["error"]
        except (ValueError, KeyError, TypeError):
            return None
    return error.get("code") if isinstance(error, dict) else None


class Load:
    """Clients that send a mix of requests until a deadline, tallying every outcome."""

    def __init__(self, url: str, reference: dict[Prompt, str], seed: int) -> None:
        self.url = url
        self.reference = reference
        self.seed = seed
        self.tally: dict[str, int] = {}
        self.failures: list[str] = []
        self.greedy_checked = 0

    def _count(self, kind: str, failure: str | None = None) -> None:
        self.tally[kind] = self.tally.get(kind, 0) + 1
        if failure is not None and len(self.failures) < 20:
            self.failures.append(failure)

    async def _one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        roll = rng.random()
        stream = rng.random() < 0.6
        if roll < 0.5:
            prompt = rng.choice(list(self.reference))
            body = prompt.body(stream=stream, max_tokens=GREEDY_MAX_TOKENS, temperature=0.0)
        else:
            prompt = Prompt(rng.choice(SYSTEM_PROMPTS), rng.choice(QUESTIONS), rng.random() < 0.5)
            body = prompt.body(
                stream=stream or roll > 0.9,
                max_tokens=rng.randint(*SAMPLED_MAX_TOKENS),
                temperature=0.8,
            )
        answer = await _exchange(client, body, hang_up=roll > 0.9)
        self._judge(prompt, body, answer)

    def _judge(self, prompt: Prompt, body: dict, answer: dict) -> None:
        if answer.get("hung_up"):
            return self._count("aborted")
        if (answer["status"], _error_code(answer)) in BACK_PRESSURE:
            return self._count("rejected")
        if answer["status"] != 200 or "error" in answer:
            return self._count("failed", f"{body.get('stream')}: {answer}")
        if body["temperature"] == 0.0:
            self.greedy_checked += 1
            if answer["text"] != self.reference[prompt]:
                return self._count(
                    "wrong", f"greedy {prompt}: {answer['text']!r} != {self.reference[prompt]!r}"
                )
        self._count("completed")

    async def run(self, num_clients: int, duration_s: float) -> None:
        deadline = time.monotonic() + duration_s

        async def client_loop(client: httpx.AsyncClient, index: int) -> None:
            rng = random.Random(self.seed * 1000 + index)
            while time.monotonic() < deadline:
                try:
                    await self._one(client, rng)
                except httpx.HTTPError as error:
                    self._count("failed", f"transport: {error!r}")

        async with client_pool(self.url, num_clients) as client:
            await asyncio.gather(*(client_loop(client, i) for i in range(num_clients)))


def private_rss_bytes(pid: int) -> int:
    """Resident memory of a process less its shared-memory pages: Ray maps its object store
    into every worker, and the pages of it a process touches count in its RSS without being
    its own (the router's RSS rose from 115 to 289 MiB that way while reading snapshots)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssShmem"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"] - fields.get("RssShmem", 0)


def _actor_pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)


class MemorySampler:
    """Resident memory of named processes, sampled every ``RSS_SAMPLE_S`` seconds."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, dict[str, int]]] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            sample = {name: private_rss_bytes(pid) for name, pid in self.pids.items()}
            self.samples.append((now, sample))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RSS_SAMPLE_S)

    def quarters(self, start: float, end: float) -> dict[str, list[float]]:
        """Mean MiB of each process over the second and the last quarter of [start, end]."""
        span = (end - start) / 4

        def mean(name: str, lo: float, hi: float) -> float:
            values = [s[name] for t, s in self.samples if lo <= t <= hi]
            return round(statistics.fmean(values) / 2**20, 1) if values else float("nan")

        return {
            name: [mean(name, start + span, start + 2 * span), mean(name, start + 3 * span, end)]
            for name in self.pids
        }


async def _kill_loop(
    backend, every_s: float, stop: asyncio.Event, wait_live: Callable[[], None]
) -> int:
    kills = 0
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return kills
        except TimeoutError:
            pass
        ray.kill(backend.replicas[0], no_restart=False)
        kills += 1
        await asyncio.to_thread(wait_live)


def run_soak(
    url: str, backend, duration_s: float, kill_every_s: float, seed: int = 0
) -> SoakReport:
    """The soak against a running deployment (``serve_on_ray(soak_config(), ...)``)."""
    report = SoakReport()
    reference = asyncio.run(reference_outputs(url, greedy_prompts()))
    pids = {"http_front": os.getpid(), "router": _actor_pid(backend.router)}
    pids["replica_1"] = _actor_pid(backend.replicas[1])

    def wait_live() -> None:
        def live() -> bool:
            health = httpx.get(f"{url}/health", timeout=30).json()
            return health["live_replicas"] == 2

        wait_for(live, "both replicas to be live again", RESTART_TIMEOUT_S, interval_s=0.5)

    async def scenario() -> tuple[Load, MemorySampler, int, float, float]:
        load, sampler, stop = Load(url, reference, seed), MemorySampler(pids), asyncio.Event()
        start = time.monotonic()
        sampling = asyncio.create_task(sampler.run(stop))
        killing = asyncio.create_task(_kill_loop(backend, kill_every_s, stop, wait_live))
        await load.run(num_clients=6, duration_s=duration_s)
        end = time.monotonic()
        stop.set()
        await sampling
        return load, sampler, await killing, start, end

    resumed_before = _resumed(url)
    load, sampler, report.kills, start, end = asyncio.run(scenario())
    report.duration_s = round(end - start, 1)
    report.requests = dict(sorted(load.tally.items()))
    report.greedy_checked = load.greedy_checked
    report.resumed = _resumed(url) - resumed_before
    report.failures = list(load.failures)
    wait_live()
    try:
        wait_until_clean(backend)
    except AssertionError as error:
        report.failures.append(str(error))
    report.rss_mib = sampler.quarters(start, end)
    for name, (second, last) in report.rss_mib.items():
        if not abs(last - second) <= RSS_TOLERANCE * second:
            report.failures.append(f"{name} RSS {second} MiB -> {last} MiB (over 5%)")
    figures("soak", **asdict(report))
    return report


def _resumed(url: str) -> float:
    from tests.reliability.conftest import metric_sum, scrape

    return metric_sum(scrape(url), "strata_requests_resumed_total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the load")
    parser.add_argument("--kill-every-s", type=float, default=180.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    with serve_on_ray(soak_config(), "soak") as (server, backend):
        report = run_soak(server.url, backend, args.minutes * 60, args.kill_every_s, args.seed)
    print(json.dumps(asdict(report), indent=2))
    raise SystemExit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
