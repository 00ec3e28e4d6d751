"""http-overhead: what the serving path costs, from the offline API to streaming over HTTP.

The same batch of requests (a few shared system prompts plus a unique text each, greedy, EOS
ignored, every request sent at once) goes through four paths, side by side in one run:
``llm``, the offline ``cluster.LLM`` with its engine in this process; ``async-engine``, an
``AsyncEngine`` over an engine in this process (the loop a replica runs, steps in a worker
thread), every request streamed concurrently; ``http``, ``strata serve`` with every request a
concurrent non-streaming ``/v1/completions``; ``http-stream``, the same server streaming, every
SSE chunk read. Each at dp 1 and dp 2: one server per dp, started with its default sizing, on
loopback. The replicas' torch threads are read from the server's log and the in-process engines
compute with as many (*equal threads*); ``llm`` also runs with dp times as many threads (one
engine on the replicas' CPUs) and with torch's default threads (*default settings*, against the
default server). In every round each mode runs once, in an order that rotates, after its engine's
prefix cache was reset; one unrecorded warm-up round comes first.
Per mode and round: output tokens/s (completion tokens over the batch's wall time), TTFT
(request sent to its first text; the first token's time for ``llm``; none for non-streaming
``http``), inter-token latency (gaps between pieces of text: SSE chunks, or the ``AsyncEngine``
outputs a chunk would carry), the engines' step time and the gaps between steps while requests
were unfinished (``EngineStats.steps``, on the server from ``/metrics``) as shares of wall time
times replicas, and CPU seconds per 1000 output tokens: this process (``benchmark``) and, for
the server, its own process (``front``: HTTP and the Ray driver), its replica and router actors
(``ray workers``) and every other process under it (``ray system``: raylet, GCS, agents);
for the server also its front's own accounts (``FrontStats``, ``strata_front_*`` in
``/metrics``): time each request waited for routing, requests per coalesced router call,
outputs per output-stream message and messages per engine step, and the time from a stream
message being announced to its outputs reaching their requests (fetch, deserialization,
dispatch and waits for the front's event loop).
"""

import ast
import asyncio
import json
import os
import random
import re
import string
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import torch
from matplotlib.figure import Figure

from benchmarks.http_load import free_port, stop_server, wait_healthy
from benchmarks.report import Report, fmt, new_figure
from benchmarks.workload import median, rotated
from cluster import LLM, SamplingParams
from cluster.config import ClusterConfig, ModelConfig
from replicas.engine.async_engine import AsyncEngine
from replicas.engine.engine import Engine, StepTimes

NAME = "http-overhead"
ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"  # byte tokenizer: a prompt's tokens are its UTF-8 bytes plus BOS
DTYPE = "float32"
TORCH_DEFAULT_THREADS = torch.get_num_threads()  # read at import, before --threads is applied
PREFIXES = [
    "You are Strata's support assistant. Answer briefly, precisely and politely. ",
    "System: a conversation about prefix caches, KV blocks, replicas and routing. ",
    "Context: KV blocks move between the NPU tier and the host tier of a replica. ",
    "Instructions: summarise the request below in one sentence, then answer it. ",
]
SUFFIX_CHARS = string.ascii_lowercase + " "
ACTORS = ("ReplicaActor", "RouterActor")  # in the process titles of Strata's Ray actors
KINDS = ("llm", "async-engine", "http", "http-stream")
CPU_GROUPS = ("front", "ray workers", "ray system", "benchmark")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TARGETS = {  # ratio -> (comparison, bound)
    "default serve / default in-process": (">=", 0.9),
    "http / in-process (equal threads)": (">=", 0.95),
    "http-stream / in-process (equal threads)": (">=", 0.95),
    "http-stream ITL p50 / async-engine ITL p50": ("<=", 1.2),
}


@dataclass(frozen=True, slots=True)
class Settings:
    num_prompts: int = 64  # all sent at once
    suffix_len: tuple[int, int] = (20, 100)  # characters of each prompt's unique text
    max_tokens: int = 64
    rounds: int = 5
    warmup_rounds: int = 1  # whole rounds run first and not recorded
    dps: tuple[int, ...] = (1, 2)
    seed: int = 0


QUICK = Settings(num_prompts=8, max_tokens=8, rounds=1, dps=(2,))  # one server start


@dataclass(frozen=True, slots=True)
class Mode:
    kind: str  # llm, async-engine, http or http-stream
    threads: int  # torch threads of the in-process engine, or of each replica
    roles: tuple[str, ...] = ()  # what the mode stands for in the ratios

    @property
    def name(self) -> str:
        return f"{self.kind} ({', '.join(self.roles)})" if self.kind == "llm" else self.kind


@dataclass(slots=True)
class Batch:
    """What the client saw of one batch."""

    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]


@dataclass(slots=True)
class Sample:
    """One mode's batch in one round, with what its engines and processes did meanwhile."""

    batch: Batch
    steps: dict[str, float]  # StepTimes fields, summed over replicas
    cpu_s: dict[str, float]  # CPU group -> seconds
    load_1m: float  # the machine's load average when the batch started
    front: dict[str, float]  # the server front's FrontStats counters (http modes; else empty)


class Server:
    """``strata serve tiny --dtype float32 -dp DP`` with its default sizing, on a free loopback
    port; its replicas' torch threads are read from its log."""

    def __init__(self, dp: int, log: Path, cpus_per_replica: float | None = None) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cluster.cli", "serve", MODEL, "--dtype", DTYPE]
                + ["-dp", str(dp), "--host", "127.0.0.1", "--port", str(port)]
                + (
                    []
                    if cpus_per_replica is None
                    else ["--cpus-per-replica", str(cpus_per_replica)]
                ),
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
            )
        try:
            wait_healthy(self.base, self.process, log)
        except BaseException:
            stop_server(self.process)
            raise
        self.replicas = replica_infos(log.read_text())

    def reset_prefix_cache(self) -> None:
        httpx.post(f"{self.base}/v1/admin/reset_prefix_cache", timeout=60).raise_for_status()

    def step_times(self) -> StepTimes:
        """The replicas' ``EngineStats.steps``, summed, from ``/metrics``."""
        text = httpx.get(f"{self.base}/metrics", timeout=60).text
        totals = {"steps": 0.0, "step_seconds": 0.0, "gap_seconds": 0.0}
        for line in text.splitlines():
            name, _, value = line.partition("{")
            key = name.removeprefix("strata_engine_").removesuffix("_total")
            if name.startswith("strata_engine_") and key in totals:
                totals[key] += float(value.rsplit(" ", 1)[1])
        return StepTimes(int(totals["steps"]), totals["step_seconds"], totals["gap_seconds"])

    def front_counters(self) -> dict[str, float]:
        """The front's ``FrontStats`` counters (``strata_front_*`` in ``/metrics``)."""
        text = httpx.get(f"{self.base}/metrics", timeout=60).text
        counters = {}
        for line in text.splitlines():
            if line.startswith("strata_front_") and "_total " in line:
                name, value = line.split(" ")
                counters[name.removeprefix("strata_front_").removesuffix("_total")] = float(value)
        return counters

    def stop(self) -> None:
        stop_server(self.process)


def replica_infos(log: str) -> list[dict]:
    """Each replica's info (``num_threads``, ``pid``, ...) from the server's "deployed" line;
    empty if the log has none."""
    match = re.search(r"deployed \d+ replicas of .*?: (\[.*\])$", log, re.MULTILINE)
    return ast.literal_eval(match.group(1)) if match else []


def build_prompts(settings: Settings) -> list[str]:
    rng = random.Random(settings.seed)
    prompts = []
    for index in range(settings.num_prompts):
        suffix = "".join(rng.choice(SUFFIX_CHARS) for _ in range(rng.randint(*settings.suffix_len)))
        prompts.append(f"{PREFIXES[index % len(PREFIXES)]}Request {index}: {suffix}")
    return prompts


# ---- CPU time --------------------------------------------------------------------------------
def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of ``root`` and every process below it, by pid, each with
    its group: ``front`` (``root``), ``ray workers`` (Strata's actors), ``ray system``."""
    table: dict[int, tuple[int, float]] = {}  # pid -> (parent pid, CPU seconds)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
        table[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    result: dict[int, tuple[str, float]] = {}
    pending = [root] if root in table else []
    while pending:
        pid = pending.pop()
        pending += children.get(pid, [])
        result[pid] = (_group(pid, root), table[pid][1])
    return result


def _group(pid: int, root: int) -> str:
    if pid == root:
        return "front"
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except OSError:
        return "ray system"
    is_actor = title.startswith("ray::") and any(actor in title for actor in ACTORS)
    return "ray workers" if is_actor else "ray system"


def cpu_delta(
    after: dict[int, tuple[str, float]], before: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds per group between two ``tree_cpu`` readings (a process started in between
    counts from zero)."""
    totals = dict.fromkeys(("front", "ray workers", "ray system"), 0.0)
    for pid, (group, seconds) in after.items():
        totals[group] += seconds - before.get(pid, (group, 0.0))[1]
    return totals


# ---- one batch per path ----------------------------------------------------------------------
def _check(path: str, prompt_tokens: int, expected_prompt: int, output: int, expected: int) -> None:
    if prompt_tokens != expected_prompt or output != expected:
        raise RuntimeError(
            f"{path}: a request had {prompt_tokens} prompt tokens (expected {expected_prompt}) "
            f"and {output} output tokens (expected {expected})"
        )


def llm_batch(llm: LLM, prompts: list[str], lengths: list[int], max_tokens: int) -> Batch:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.monotonic()  # the engine stamps first tokens with time.monotonic too
    outputs = llm.generate(prompts, params)
    wall = time.monotonic() - start
    for output, length in zip(outputs, lengths):
        _check("llm", len(output.prompt_token_ids), length, len(output.token_ids), max_tokens)
    return Batch(wall, len(outputs) * max_tokens, [o.first_token_time - start for o in outputs], [])


async def async_engine_batch(
    engine: Engine, prompts: list[str], lengths: list[int], max_tokens: int
) -> tuple[Batch, int]:
    """The batch through a fresh ``AsyncEngine`` (steps in a worker thread, like a replica's),
    and the torch threads that worker threads compute with."""
    front = AsyncEngine(engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(index: int, prompt: str) -> tuple[int, float, list[float]]:
        sent = time.monotonic()
        first = last = final = None
        gaps = []
        async for output in front.generate(f"async-{index}", prompt, params):
            now = time.monotonic()
            if output.new_text:  # what the server would send as a chunk
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
            final = output
        tokens = len(final.token_ids)
        _check("async-engine", len(final.prompt_token_ids), lengths[index], tokens, max_tokens)
        return tokens, first - sent, gaps

    start = time.monotonic()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.monotonic() - start
    # New worker threads take torch's thread count when they first compute.
    threads = await asyncio.to_thread(torch.get_num_threads)
    batch = Batch(
        wall,
        sum(tokens for tokens, _, _ in results),
        [ttft for _, ttft, _ in results],
        [gap for _, _, gaps in results for gap in gaps],
    )
    return batch, threads


async def http_batch(
    base: str, prompts: list[str], lengths: list[int], max_tokens: int, stream: bool
) -> Batch:
    """Every prompt as one concurrent request over its own connection. The client is aiohttp
    (C parsers; httpx costs about three times its CPU per SSE chunk), so that on a small
    machine the client takes as little as possible from the server it measures; its CPU time
    is reported as ``benchmark``."""
    connector = aiohttp.TCPConnector(limit=len(prompts))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout) as http:
        start = time.monotonic()
        results = await asyncio.gather(
            *(
                _http_one(http, prompt, length, max_tokens, stream)
                for prompt, length in zip(prompts, lengths)
            )
        )
        wall = time.monotonic() - start
    return Batch(
        wall,
        sum(tokens for tokens, _, _ in results),
        [ttft for _, ttft, _ in results if ttft is not None],
        [gap for _, _, gaps in results for gap in gaps],
    )


async def _http_one(
    http: aiohttp.ClientSession, prompt: str, length: int, max_tokens: int, stream: bool
) -> tuple[int, float | None, list[float]]:
    body: dict[str, object] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    path = "http-stream" if stream else "http"
    if not stream:
        async with http.post("/v1/completions", json=body) as response:
            response.raise_for_status()
            usage = (await response.json())["usage"]
        _check(path, usage["prompt_tokens"], length, usage["completion_tokens"], max_tokens)
        return usage["completion_tokens"], None, []
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first = last = usage = None
    gaps = []
    async with http.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue  # the blank line between events, and [DONE]
            chunk = json.loads(line[6:])
            now = time.monotonic()
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None or first is None:
        raise RuntimeError(f"{path}: a stream ended without text or usage")
    _check(path, usage["prompt_tokens"], length, usage["completion_tokens"], max_tokens)
    return usage["completion_tokens"], first - sent, gaps


# ---- the run ---------------------------------------------------------------------------------
def modes_for(dp: int, threads: int) -> list[Mode]:
    """Every mode of one dp; ``llm`` runs once per distinct thread count, with all its roles."""
    roles: dict[int, list[str]] = {threads: ["equal threads"]}
    if dp > 1:
        roles.setdefault(dp * threads, []).append(f"{dp} x equal threads")
    roles.setdefault(TORCH_DEFAULT_THREADS, []).append("torch default")
    modes = [Mode("llm", t, tuple(r)) for t, r in roles.items()]
    modes.append(Mode("async-engine", threads, ("equal threads",)))
    modes += [Mode(kind, threads, ("default serve",)) for kind in ("http", "http-stream")]
    return modes


def measure(
    mode: Mode,
    settings: Settings,
    prompts: list[str],
    lengths: list[int],
    llm: LLM,
    engine: Engine,
    server: Server,
) -> Sample:
    """Reset the mode's prefix cache, run its batch, and read what its engines did meanwhile."""
    if mode.kind in ("llm", "async-engine"):
        torch.set_num_threads(mode.threads)
    read_steps: Callable[[], StepTimes] = {
        "llm": lambda: llm.stats().steps,
        "async-engine": lambda: engine.stats().steps,
    }.get(mode.kind, server.step_times)
    reset: Callable[[], None] = {
        "llm": llm.reset_prefix_cache,
        "async-engine": engine.reset_prefix_cache,
    }.get(mode.kind, server.reset_prefix_cache)
    reset()
    steps_before = read_steps()
    load = os.getloadavg()[0]
    is_http = mode.kind.startswith("http")
    server_before = tree_cpu(server.process.pid) if is_http else {}
    front_before = server.front_counters() if is_http else {}
    cpu_before = time.process_time()
    if mode.kind == "llm":
        batch = llm_batch(llm, prompts, lengths, settings.max_tokens)
    elif mode.kind == "async-engine":
        batch, threads = asyncio.run(
            async_engine_batch(engine, prompts, lengths, settings.max_tokens)
        )
        if threads != mode.threads:
            raise RuntimeError(f"async-engine computed with {threads} threads, not {mode.threads}")
    else:
        batch = asyncio.run(
            http_batch(
                server.base, prompts, lengths, settings.max_tokens, mode.kind == "http-stream"
            )
        )
    cpu = {"benchmark": time.process_time() - cpu_before}
    front = {}
    if is_http:
        cpu |= cpu_delta(tree_cpu(server.process.pid), server_before)
        front = {k: v - front_before.get(k, 0.0) for k, v in server.front_counters().items()}
    steps_after = read_steps()
    steps = {
        key: getattr(steps_after, key) - getattr(steps_before, key)
        for key in ("num_steps", "step_seconds", "gap_seconds")
    }
    return Sample(batch, steps, cpu, load, front)


def summarize(samples: Sequence[Sample], replicas: int) -> dict[str, object]:
    rates = [s.batch.output_tokens / s.batch.wall_s for s in samples]
    ttft = [t for s in samples for t in s.batch.ttft_s]
    itl = [t for s in samples for t in s.batch.itl_s]
    groups = [g for g in CPU_GROUPS if g in samples[0].cpu_s]
    return {
        "output_tokens_per_s": median(rates),
        "output_tokens_per_s_min": min(rates),
        "output_tokens_per_s_max": max(rates),
        "ttft_p50_s": median(ttft) if ttft else None,
        "itl_p50_s": median(itl) if itl else None,
        "step_share": median(
            [s.steps["step_seconds"] / (s.batch.wall_s * replicas) for s in samples]
        ),
        "gap_share": median(
            [s.steps["gap_seconds"] / (s.batch.wall_s * replicas) for s in samples]
        ),
        "front": _front_summary(samples),
        "cpu_s_per_1k_tokens": {
            g: median([1e3 * s.cpu_s[g] / s.batch.output_tokens for s in samples]) for g in groups
        },
    }


def _front_summary(samples: Sequence[Sample]) -> dict[str, float] | None:
    """Medians over rounds of what the server's front spent per request, per step and per
    token: routing waits, coalescing, and reading the replicas' output streams."""
    fronts = [(s.front, s) for s in samples if s.front.get("routes")]
    if not fronts:
        return None
    return {
        "route_wait_ms": median([1e3 * f["route_seconds"] / f["routes"] for f, _ in fronts]),
        "requests_per_route_call": median([f["routes"] / f["route_calls"] for f, _ in fronts]),
        "outputs_per_stream_message": median(
            [f["stream_items"] / f["stream_messages"] for f, _ in fronts]
        ),
        "stream_messages_per_step": median(
            [f["stream_messages"] / s.steps["num_steps"] for f, s in fronts]
        ),
        "stream_s_per_1k_tokens": median(
            [1e3 * f["stream_seconds"] / s.batch.output_tokens for f, s in fronts]
        ),
    }


def run_dp(
    dp: int,
    settings: Settings,
    prompts: list[str],
    lengths: list[int],
    llm: LLM,
    engine: Engine,
    output_dir: Path,
    cpus_per_replica: float | None = None,
) -> dict[str, object]:
    server = Server(dp, output_dir / f"serve-dp{dp}.log", cpus_per_replica)
    try:
        replica_threads = [info["num_threads"] for info in server.replicas]
        if replica_threads and len(set(replica_threads)) == 1:
            threads = replica_threads[0]
        else:  # not in the log: the in-process engines keep this process's threads
            threads = torch.get_num_threads()
        modes = modes_for(dp, threads)
        samples: dict[Mode, list[Sample]] = {mode: [] for mode in modes}
        for rep in range(-settings.warmup_rounds, settings.rounds):
            for mode in rotated(modes, rep):
                sample = measure(mode, settings, prompts, lengths, llm, engine, server)
                if rep >= 0:
                    samples[mode].append(sample)
            label = "warm-up" if rep < 0 else f"round {rep + 1}/{settings.rounds}"
            print(f"dp {dp}: {label} done", flush=True)
    finally:
        server.stop()
    results = [
        {
            "name": mode.name,
            "kind": mode.kind,
            "threads": mode.threads,
            "roles": list(mode.roles),
            **summarize(samples[mode], dp if mode.kind.startswith("http") else 1),
            "samples": [asdict(s) for s in samples[mode]],
        }
        for mode in modes
    ]
    llm_equal = _find(results, "llm", "equal threads")["output_tokens_per_s"]
    for result in results:
        result["over_llm_equal_threads"] = result["output_tokens_per_s"] / llm_equal
    loads = [s.load_1m for mode_samples in samples.values() for s in mode_samples]
    return {
        "dp": dp,
        "replica_threads": replica_threads or None,  # None: not found in the server's log
        "threads": threads,
        "load_1m_range": [min(loads), max(loads)],
        "modes": results,
        "ratios": _ratios(results),
    }


def _find(modes: list[dict], kind: str, role: str) -> dict:
    return next(m for m in modes if m["kind"] == kind and role in m["roles"])


def _ratios(modes: list[dict]) -> dict[str, float]:
    http, stream = (
        _find(modes, "http", "default serve"),
        _find(modes, "http-stream", "default serve"),
    )
    return {
        "default serve / default in-process": http["output_tokens_per_s"]
        / _find(modes, "llm", "torch default")["output_tokens_per_s"],
        "http / in-process (equal threads)": http["over_llm_equal_threads"],
        "http-stream / in-process (equal threads)": stream["over_llm_equal_threads"],
        "http-stream ITL p50 / async-engine ITL p50": stream["itl_p50_s"]
        / _find(modes, "async-engine", "equal threads")["itl_p50_s"],
    }


def run(
    output_dir: Path, *, quick: bool, command: str, cpus_per_replica: float | None = None
) -> dict[str, object]:
    """``cpus_per_replica`` starts the servers with ``--cpus-per-replica`` instead of their
    default sizing (the ``default serve`` ratio then compares that sizing)."""
    settings = QUICK if quick else Settings()
    output_dir.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(settings)
    start_threads = torch.get_num_threads()
    # The same engine configuration as the server's replicas: the defaults of every section.
    config = ClusterConfig(model=ModelConfig(model=MODEL, dtype=DTYPE))
    llm = LLM.from_config(config)
    engine = Engine(config.engine_config())
    lengths = [len(llm.tokenizer.encode(p)) for p in prompts]
    try:
        per_dp = [
            run_dp(dp, settings, prompts, lengths, llm, engine, output_dir, cpus_per_replica)
            for dp in settings.dps
        ]
        llm.check_integrity()
        engine.check_integrity()
    finally:
        llm.shutdown()
        torch.set_num_threads(start_threads)

    report = Report(
        NAME,
        f"Serving-path overhead: {settings.num_prompts} requests at once through cluster.LLM, "
        "AsyncEngine and strata serve",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    for entry in per_dp:
        _add_dp_table(report, entry, settings)
    report.add_table(
        "Ratios (of medians over rounds) and targets",
        ["dp", "ratio", "value", "target", "met"],
        [
            [entry["dp"], name, value, f"{op} {bound:g}", _met(value, op, bound)]
            for entry in per_dp
            for name, value in entry["ratios"].items()
            for op, bound in [TARGETS[name]]
        ],
    )
    report.figures["http_overhead.png"] = _plot(per_dp)
    report.results = {
        "model": MODEL,
        "dtype": DTYPE,
        "settings": asdict(settings),
        "torch_default_threads": TORCH_DEFAULT_THREADS,
        "prompt_tokens": lengths,
        "targets": {name: {"op": op, "bound": bound} for name, (op, bound) in TARGETS.items()},
        "dps": per_dp,
    }
    return report.write(output_dir)


def _met(value: float, op: str, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound


def _add_dp_table(report: Report, entry: dict, settings: Settings) -> None:
    dp, threads = entry["dp"], entry["threads"]
    source = "from the server's log" if entry["replica_threads"] else "unknown: not in the log"
    low, high = entry["load_1m_range"]

    def ms(value: float | None) -> object:
        return "—" if value is None else 1e3 * value

    rows = []
    for m in entry["modes"]:
        cpu = m["cpu_s_per_1k_tokens"]
        server = m["kind"].startswith("http")
        rows.append(
            [m["name"], f"{m['threads']} per replica" if server else m["threads"]]
            + [
                f"{fmt(m['output_tokens_per_s'])} ({fmt(m['output_tokens_per_s_min'])}–"
                f"{fmt(m['output_tokens_per_s_max'])})",
                m["over_llm_equal_threads"],
                ms(m["ttft_p50_s"]),
                ms(m["itl_p50_s"]),
                m["step_share"],
                m["gap_share"],
            ]
            + [cpu.get(g, "—") for g in CPU_GROUPS]
        )
    report.add_table(
        f"dp {dp}: {settings.num_prompts} requests at once, {settings.max_tokens} output tokens "
        f"each, medians over {settings.rounds} rounds (torch threads: {threads} per replica, "
        f"{source}; torch's default {TORCH_DEFAULT_THREADS}; load average {low:.1f}-{high:.1f})",
        ["mode", "threads", "output tok/s (min–max)", "/ llm (equal threads)"]
        + ["TTFT p50 (ms)", "ITL p50 (ms)", "engine step share", "gap share"]
        + [f"CPU s / 1k tok: {g}" for g in CPU_GROUPS],
        rows,
    )
    fronts = [m for m in entry["modes"] if m.get("front")]
    if fronts:
        keys = list(fronts[0]["front"])
        report.add_table(
            f"dp {dp}: the server front's share (medians over rounds): routing wait per request, "
            "requests per coalesced router call, outputs per output-stream message, messages "
            "per engine step (all replicas), stream handling (announced to delivered, event-loop "
            "waits included) per 1k tokens",
            ["mode", *keys],
            [[m["name"], *(m["front"][k] for k in keys)] for m in fronts],
        )


def _plot(per_dp: list[dict]) -> Figure:
    figure, axes = new_figure(len(per_dp))
    for axis, entry in zip(axes, per_dp):
        modes = entry["modes"]
        rates = [m["output_tokens_per_s"] for m in modes]
        errors = [
            [r - m["output_tokens_per_s_min"] for r, m in zip(rates, modes)],
            [m["output_tokens_per_s_max"] - r for r, m in zip(rates, modes)],
        ]
        labels = [
            f"{m['name']}\n{m['threads']} threads" + " per replica" * m["kind"].startswith("http")
            for m in modes
        ]
        axis.bar(
            range(len(modes)),
            rates,
            yerr=errors,
            capsize=3,
            color=[f"C{KINDS.index(m['kind'])}" for m in modes],
        )
        axis.set_xticks(range(len(modes)), labels, rotation=30, ha="right", fontsize=7)
        axis.set_ylabel("output tokens/s (median, min–max)")
        axis.set_title(f"dp {entry['dp']}")
    return figure
