"""Bounded HTTP traffic for the reliability tests: clients that check every answer they get, and
clients that hang up at random points. Loopback only; every loop is bounded in count and time.

An answer is one of (``Outcome.kind``):

    served     200 and complete: [DONE] (streams), finish_reason, and the tokens asked for
    rejected   429 or 503 that never ran (code overloaded / no_live_replica), OpenAI-shaped
    failed     ran and was lost with its replica: a 503 replica_failed body, or an SSE error
               event (OpenAI-shaped) followed by [DONE]
    error      anything else: another status, a malformed answer, a transport error, a hang
"""

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from tests.reliability.conftest import assert_openai_error

REQUEST_TIMEOUT_S = 120.0
MAX_REQUESTS_PER_CLIENT = 5_000
SHARED_PREFIXES = [
    "You are Strata's support assistant. Answer in one short sentence. ",
    "System: the following is a conversation about prefix caches and routing. ",
    "Context document 7: KV blocks move between the NPU tier and the host tier. ",
    "Template v2 -- summarise the user's request, then answer it politely. ",
]


@dataclass(slots=True)
class Outcome:
    kind: str  # served | rejected | failed | error
    detail: str = ""
    status: int = 0
    message: str = ""  # the error message of a rejected or failed request
    body: dict | None = None  # the request
    text: str = ""  # a served answer's text (a stream's deltas joined)
    tokens: list[tuple[str, float]] | None = None  # (token, logprob) when asked for logprobs


@dataclass
class Tally:
    """Outcomes of many requests, with the error details kept for the assertion message."""

    kinds: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    num_completion_tokens: int = 0
    elapsed_s: float = 0.0
    timeline: list[tuple[float, float, Outcome]] = field(default_factory=list)
    """(sent, answered, outcome) of every request, in ``time.monotonic()`` seconds."""

    def add(self, outcome: Outcome, sent: float = 0.0, answered: float = 0.0) -> None:
        self.timeline.append((sent, answered, outcome))
        self.kinds[outcome.kind] += 1
        if outcome.kind in ("rejected", "failed"):
            self.codes[f"{outcome.status}:{outcome.detail}"] += 1
        if outcome.kind == "error" and len(self.errors) < 20:
            self.errors.append(outcome.detail)

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def summary(self) -> str:
        return (
            f"{self.total} requests in {self.elapsed_s:.1f} s: {dict(self.kinds)}, "
            f"rejections/failures by code {dict(self.codes)}, "
            f"{self.num_completion_tokens} tokens streamed"
        )


def request_body(
    rng: random.Random, *, stream: bool, max_tokens: int, chat: bool, logprobs: bool = False
) -> dict:
    """A request; with ``logprobs``, greedy ones ask for each token's logprob."""
    prompt = rng.choice(SHARED_PREFIXES) + f"Question {rng.randrange(10**6)}?"
    body: dict = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    body["temperature"] = rng.choice([0.0, 0.7])
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if logprobs and body["temperature"] == 0.0:
        body["logprobs"] = True if chat else 1
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _error_outcome(status: int, raw: bytes) -> Outcome:
    try:
        error = assert_openai_error(json.loads(raw))
    except (AssertionError, ValueError):
        return Outcome("error", f"{status} without an OpenAI error body: {raw[:300]!r}", status)
    code = error["code"] or ""
    if (status, code) in ((429, "overloaded"), (503, "no_live_replica")):
        return Outcome("rejected", code, status, error["message"])
    if (status, code) == (503, "replica_failed"):
        return Outcome("failed", code, status, error["message"])
    return Outcome("error", f"unexpected {status}: {error}", status)


async def _read_stream(response: httpx.Response, body: dict, tally: Tally) -> Outcome:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            events.append(line.removeprefix("data: "))
    if not events or events[-1] != "[DONE]":
        return Outcome("error", f"stream ended without [DONE]: {events[-3:]}", 200)
    payloads = [json.loads(event) for event in events[:-1]]
    errors = [p for p in payloads if "error" in p]
    if errors:
        try:
            error = assert_openai_error(errors[0])
        except AssertionError as failure:
            return Outcome("error", f"malformed error event: {failure}", 200)
        if error["code"] != "replica_failed":
            return Outcome("error", f"unexpected error event: {error}", 200)
        return Outcome("failed", "replica_failed(stream)", 200, error["message"])
    finish = [c["finish_reason"] for p in payloads for c in p.get("choices", [])]
    usage = payloads[-1].get("usage") or {}
    if finish[-1:] != ["length"] or usage.get("completion_tokens") != body["max_tokens"]:
        return Outcome("error", f"incomplete stream: finish {finish[-1:]}, usage {usage}", 200)
    tally.num_completion_tokens += usage["completion_tokens"]
    text, tokens = _answer([c for p in payloads for c in p.get("choices", [])], stream=True)
    return Outcome("served", status=200, text=text, tokens=tokens)


def _answer(choices: list[dict], *, stream: bool) -> tuple[str, list[tuple[str, float]] | None]:
    """The text of one choice's chunks (or answer), and its (token, logprob) pairs if any."""
    text, tokens = "", None
    for choice in choices:
        message = choice.get("delta" if stream else "message")
        text += choice["text"] if message is None else message.get("content") or ""
        logprobs = choice.get("logprobs")
        if logprobs:
            tokens = tokens or []
            if "content" in logprobs:
                tokens += [(e["token"], e["logprob"]) for e in logprobs["content"]]
            else:
                tokens += list(zip(logprobs["tokens"], logprobs["token_logprobs"]))
    return text, tokens


async def send(client: httpx.AsyncClient, body: dict, tally: Tally) -> Outcome:
    """One request, checked; never raises, never waits past ``REQUEST_TIMEOUT_S``."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    stage = ["before the response's headers"]  # where a transport error struck, for its message

    async def exchange() -> Outcome:
        async with client.stream("POST", path, json=body) as response:
            stage[0] = "after the response's headers"
            if response.status_code != 200:
                return _error_outcome(response.status_code, await response.aread())
            if body["stream"]:
                return await _read_stream(response, body, tally)
            answer = json.loads(await response.aread())
            usage = answer.get("usage") or {}
            if usage.get("completion_tokens") != body["max_tokens"]:
                return Outcome("error", f"incomplete answer: {answer}", 200)
            tally.num_completion_tokens += usage["completion_tokens"]
            text, tokens = _answer(answer["choices"], stream=False)
            return Outcome("served", status=200, text=text, tokens=tokens)

    try:
        outcome = await asyncio.wait_for(exchange(), REQUEST_TIMEOUT_S)
    except TimeoutError:
        outcome = Outcome("error", f"no answer within {REQUEST_TIMEOUT_S} s (a hang): {body}")
    except (httpx.HTTPError, OSError, ValueError) as error:
        cause = error.__cause__ or error.__context__
        outcome = Outcome(
            "error", f"{type(error).__name__}: {error} ({stage[0]}; cause: {cause!r}) {body}"
        )
    outcome.body = body
    return outcome


def client_pool(url: str, num_clients: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=num_clients + 8, max_keepalive_connections=num_clients)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S)


async def run_clients(
    url: str,
    num_clients: int,
    duration_s: float,
    *,
    seed: int = 0,
    stream_fraction: float = 0.9,
    chat_fraction: float = 0.25,
    max_tokens: tuple[int, int] = (4, 24),
    logprobs: bool = False,
) -> Tally:
    """``num_clients`` concurrent clients, each sending one request after another until
    ``duration_s`` has passed; a client that is rejected backs off briefly. With
    ``logprobs``, greedy requests ask for their tokens' logprobs."""
    tally = Tally()
    deadline = time.monotonic() + duration_s
    start = time.monotonic()

    async def one_client(client: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() > deadline:
                return
            body = request_body(
                rng,
                stream=rng.random() < stream_fraction,
                max_tokens=rng.randint(*max_tokens),
                chat=rng.random() < chat_fraction,
                logprobs=logprobs,
            )
            sent = time.monotonic()
            outcome = await send(client, body, tally)
            tally.add(outcome, sent, time.monotonic())
            if outcome.kind == "rejected":
                await asyncio.sleep(rng.uniform(0.05, 0.3))

    async with client_pool(url, num_clients) as client:
        await asyncio.gather(*(one_client(client, i) for i in range(num_clients)))
    tally.elapsed_s = time.monotonic() - start
    return tally


async def burst(url: str, bodies: list[dict]) -> list[Outcome]:
    """Every body at once, each on its own connection."""
    tally = Tally()
    async with client_pool(url, len(bodies)) as client:
        return list(await asyncio.gather(*(send(client, body, tally) for body in bodies)))


# ---- clients that hang up -------------------------------------------------------------------

HANG_UP_MODES = ("partial-body", "after-headers", "mid-stream", "reset-mid-stream", "non-stream")


async def hang_up(port: int, mode: str, rng: random.Random) -> str:
    """Send a long request over a raw socket and hang up at a random point of ``mode``;
    returns what was seen before hanging up: "nothing", "headers" or "events"."""
    stream = mode != "non-stream"
    body = json.dumps(
        {
            "prompt": rng.choice(SHARED_PREFIXES) + f"drop {rng.randrange(10**6)}",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    seen = "nothing"
    try:
        if mode == "partial-body":
            writer.write(head + body[: rng.randrange(1, len(body))])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.2))
            return seen
        writer.write(head + body)
        await writer.drain()
        if mode == "non-stream":
            await asyncio.sleep(rng.uniform(0.05, 1.0))
            return seen
        received = b""
        wanted_events = 0 if mode == "after-headers" else rng.randint(1, 6)
        for _ in range(1000):  # bounded: one read per chunk
            chunk = await asyncio.wait_for(reader.read(4096), 60)
            if not chunk:
                break
            received += chunk
            if b"\r\n\r\n" in received:
                seen = "headers"
            if received.count(b"data: ") >= max(1, wanted_events):
                seen = "events" if wanted_events else seen
                break
        return seen
    finally:
        if mode == "reset-mid-stream":
            writer.transport.abort()  # RST instead of FIN
        else:
            writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 5)
