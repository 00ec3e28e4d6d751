"""The HTTP API over a real socket: uvicorn on 127.0.0.1, the official ``openai`` client, the
Prometheus exposition, and clients that hang up mid-request."""

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from cluster.api import create_app
from cluster.backend import LocalBackend
from replicas.config import EngineConfig
from replicas.engine.engine import Engine

MODEL = "tiny"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Say something about prefix caches."}]


class Server:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))  # a free port, held from now on
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(LocalBackend(engine)), log_level="warning", lifespan="off"
        )
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> "Server":
        self.thread.start()
        for _ in range(600):  # bounded start-up wait
            if self.uvicorn.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc: object) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@contextlib.contextmanager
def default_model_server() -> Iterator[Server]:
    """A server of the default real model (SmolLM2) on one torch thread, in float32 (the
    dtype its tests' reference scores are computed in; the weights as auto chooses)."""
    from replicas.model.resolve import DEFAULT_MODEL

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    config = EngineConfig(
        model=DEFAULT_MODEL, dtype="float32", num_npu_blocks=256, max_model_len=1024
    )
    engine = Engine(config)
    try:
        with Server(engine) as running:
            yield running
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = Engine(EngineConfig(model=MODEL, num_npu_blocks=128, max_model_len=1024))
    with Server(engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def scrape(server: Server) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_until_clean(engine: Engine) -> None:
    for _ in range(400):  # bounded: the abort lands at the engine loop's next gap
        if not engine.has_unfinished_requests() and engine.kv_cache.npu.num_used == 0:
            break
        time.sleep(0.025)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.npu.num_used == 0
    engine.check_integrity()


def test_completions(client):
    answer = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, **GREEDY)
    assert answer.id.startswith("cmpl-") and answer.model == MODEL
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (12, 4)

    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=4, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answer.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices


def test_chat_completions(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=3, **GREEDY
    )
    assert answer.object == "chat.completion" and answer.usage.completion_tokens == 3
    assert answer.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=3, stream=True, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == answer.choices[0].message.content


def test_repeated_prompt_reports_cached_tokens_and_metrics(client, server):
    before = scrape(server)
    prompt = "An operator's long system prompt, repeated by every request of a tenant. " * 2
    # A salt of its own: no earlier request's partial first block (BOS) is reused.
    salted = {**GREEDY, "extra_body": {**GREEDY["extra_body"], "cache_salt": "tenant-a"}}
    usages = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **salted).usage
        for _ in range(2)
    ]
    assert usages[0].prompt_tokens == usages[1].prompt_tokens == 147  # BOS + 146 bytes
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    # 9 full blocks of 16, then the 2 computed tokens of the first's partial block: all but the
    # last prompt token, which is always computed
    assert usages[1].prompt_tokens_details.cached_tokens == 146
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset({"replica": "0", **labels}.items()))
        return after[key] - before.get(key, 0.0)

    assert delta("strata_prefix_cache_queries_total") == 2 * 147
    assert delta("strata_prefix_cache_hits_total") == 146
    assert delta("strata_prefix_cache_hits_by_tier_total", tier="npu") == 146
    assert delta("strata_requests_total", finish_reason="length") == 2
    assert delta("strata_time_to_first_token_seconds_count") == 2
    assert after[("strata_kv_blocks_capacity", frozenset(
        {"replica": "0", "tier": "npu", "cache_type": "full"}.items()
    ))] == 128  # fmt: skip


def test_errors_reach_the_openai_client(client, server):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=0)
    assert error.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_p=3.0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{server.url}/health").json()
    assert (health["status"], health["live_replicas"]) == ("ok", 1)


def test_concurrent_requests_all_finish(client, server):
    def one(i: int) -> int:
        prompt = f"Request number {i} of a small burst."
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, **GREEDY)
        return answer.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(6))) == [3] * 6
    wait_until_clean(server.engine)


def raw_post(server: Server, body: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    conn.sendall(head.encode() + body)
    return conn


LONG = b'{"prompt": "tell me everything", "max_tokens": 900, "ignore_eos": true'


def num_aborted(server: Server) -> float:
    """Aborted requests on any replica label ("none" when no output named one yet)."""
    return sum(
        value
        for (name, labels), value in scrape(server).items()
        if name == "strata_requests_total" and ("finish_reason", "abort") in labels
    )


def test_streaming_client_hanging_up_aborts_its_request(server):
    aborted = num_aborted(server)
    conn = raw_post(server, LONG + b', "stream": true}')
    received = b""
    while b"data: " not in received:  # the first event arrives long before the 900th token
        chunk = conn.recv(4096)
        assert chunk, "the server closed the stream"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    conn.close()
    wait_until_clean(server.engine)
    assert num_aborted(server) == aborted + 1


def test_non_streaming_client_hanging_up_aborts_its_request(server):
    engine = server.engine
    aborted = num_aborted(server)
    conn = raw_post(server, LONG + b"}")
    for _ in range(400):  # bounded: wait until it is generating
        if engine.has_unfinished_requests() and engine.kv_cache.npu.num_used > 0:
            break
        time.sleep(0.025)
    assert engine.has_unfinished_requests()
    conn.close()
    wait_until_clean(engine)
    assert num_aborted(server) == aborted + 1  # it never finished
