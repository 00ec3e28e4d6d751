"""Hostile HTTP input, property-based: thousands of malformed or extreme requests to every
endpoint of the in-process app over one real engine.

For every request: never a 5xx, never a hang (a per-request timeout), a 4xx always carries the
OpenAI error body, and a 200 respects the configured max_tokens cap. After each batch the server
still answers a normal request correctly, and the engine holds no unfinished request and no NPU
block, and its integrity check passes.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from cluster.api import create_app
from cluster.backend import LocalBackend
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from tests.reliability.conftest import assert_openai_error

MAX_TOKENS_LIMIT = 8
MAX_BODY_BYTES = 16 * 1024
REQUEST_TIMEOUT_S = 30.0
API_KEY = "sk-fuzz"


def fuzz(max_examples: int) -> settings:
    """No example database (nothing written into the tree); a failure prints its blob."""
    return settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


@dataclass
class Harness:
    """One event loop holding the engine loop and an httpx client over the ASGI app."""

    backend: LocalBackend
    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    num_requests: int = 0

    def send(
        self,
        method: str,
        path: str,
        content: bytes | AsyncIterator[bytes] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        self.num_requests += 1
        request = self.client.request(method, path, content=content, headers=headers)
        try:
            response = self.loop.run_until_complete(asyncio.wait_for(request, REQUEST_TIMEOUT_S))
        except TimeoutError:
            pytest.fail(f"{method} {path} hung for {REQUEST_TIMEOUT_S} s: {content!r:.300}")
        assert not self.backend.async_engine.is_dead, "this request killed the engine loop"
        return response

    @property
    def engine(self) -> Engine:
        return self.backend.engine

    def settle(self) -> None:
        """Let the engine loop apply pending aborts (bounded)."""
        for _ in range(200):
            if not self.engine.has_unfinished_requests() and not self.engine.kv_cache.npu.num_used:
                return
            self.loop.run_until_complete(asyncio.sleep(0.01))


def make_harness(**app_options) -> Iterator[Harness]:
    backend = LocalBackend(Engine(EngineConfig(model="tiny", num_npu_blocks=64)))
    app = create_app(
        backend,
        max_tokens_limit=MAX_TOKENS_LIMIT,
        max_request_body_bytes=MAX_BODY_BYTES,
        **app_options,
    )
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz")
    try:
        yield Harness(backend, loop, client)
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    for running in make_harness():
        yield running
        print(f"\nFIGURES fuzz {{'requests': {running.num_requests}}}", flush=True)


def check(response: httpx.Response, method: str = "POST") -> None:
    """The invariants of every answer."""
    assert response.status_code < 500, (response.status_code, response.text[:2000])
    if response.status_code >= 400:
        if method != "HEAD":
            assert_openai_error(response.json())
        return
    content_type = response.headers.get("content-type", "")
    if method == "HEAD" or response.status_code != 200:
        return  # e.g. a redirect from a trailing slash
    if content_type.startswith("text/event-stream"):
        events = [
            line.removeprefix("data: ")
            for line in response.text.split("\n\n")
            if line.startswith("data: ")
        ]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    elif content_type.startswith("application/json"):
        body = response.json()
        if isinstance(body, dict) and "usage" in body:
            num_choices = len(body["choices"])  # n per prompt, prompts in a list
            assert num_choices >= 1, body
            # max_tokens=0 (scoring a prompt with echo) generates nothing
            assert 0 <= body["usage"]["completion_tokens"] <= MAX_TOKENS_LIMIT * num_choices, body
    elif response.request.url.path == "/metrics":
        assert list(text_string_to_metric_families(response.text)), response.text[:500]


def assert_serving_and_clean(harness: Harness) -> None:
    """A normal request still works; nothing leaked into the engine."""
    body = {"prompt": "still serving?", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    response = harness.send("POST", "/v1/completions", json.dumps(body).encode())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    harness.settle()
    engine = harness.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.npu.num_used == 0
    engine.check_integrity()


# ---- strategies -----------------------------------------------------------------------------

EXTREME_INTS = st.sampled_from(
    [0, 1, -1, 2, 7, 8, 9, 255, 256, 257, 258, 1023, 1024, 2**31, 2**63 - 1, 2**63, 2**64 - 1,
     2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30)]
)  # fmt: skip
NUMBERS = st.one_of(
    EXTREME_INTS,
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-45, 1e-30, 1e-6, 1e308, 2.0, 0.5]),
)
TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=4),
    st.sampled_from(["", " ", "\x00", "tiny", "gpt-4", "user", "system", "\ufffd" * 3]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(TEXT, inner, max_size=5)),
    max_leaves=20,
)
TOKEN_LISTS = st.lists(st.one_of(EXTREME_INTS, st.integers(-5, 300)), max_size=40)
PROMPTS = st.one_of(
    TEXT,
    st.text(min_size=1000, max_size=3000),  # long: some exceed the context
    TOKEN_LISTS,
    st.lists(TOKEN_LISTS, max_size=2),
    st.lists(TEXT, max_size=2),
    JSON_VALUES,
)
TTLS = st.one_of(st.sampled_from(["5m", "30m", "1h", "12h", "24h"]), TEXT, JSON_VALUES)
BREAKPOINTS = st.one_of(
    st.fixed_dictionaries({"mode": st.just("explicit")}, optional={"ttl": TTLS}), JSON_VALUES
)
SAMPLING_FIELDS = {
    "model": st.one_of(st.just("tiny"), TEXT, JSON_VALUES),
    "max_tokens": st.one_of(NUMBERS, JSON_VALUES),
    "temperature": st.one_of(NUMBERS, JSON_VALUES),
    "top_p": st.one_of(NUMBERS, JSON_VALUES),
    "top_k": st.one_of(NUMBERS, JSON_VALUES),
    "seed": st.one_of(NUMBERS, st.none()),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), JSON_VALUES),
    "stop_token_ids": st.one_of(TOKEN_LISTS, JSON_VALUES),
    "ignore_eos": st.one_of(st.booleans(), JSON_VALUES),
    "n": st.one_of(EXTREME_INTS, JSON_VALUES),
    "stream": st.one_of(st.booleans(), JSON_VALUES),
    "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_VALUES
    ),
    "cache_salt": st.one_of(TEXT, JSON_VALUES),
    "prompt_cache_key": st.one_of(TEXT, JSON_VALUES),
    "prompt_cache_options": st.one_of(
        st.fixed_dictionaries(
            {}, optional={"mode": st.one_of(st.just("explicit"), TEXT), "ttl": TTLS}
        ),
        JSON_VALUES,
    ),
    "prompt_cache_retention": st.one_of(st.sampled_from(["in_memory", "24h"]), TEXT, JSON_VALUES),
    "user": st.one_of(TEXT, JSON_VALUES),
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "logit_bias": st.one_of(st.just({}), JSON_VALUES),
    "logprobs": st.one_of(st.booleans(), NUMBERS),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": PROMPTS,
    "echo": st.one_of(st.booleans(), JSON_VALUES),
    "best_of": st.one_of(EXTREME_INTS, JSON_VALUES),
}
ROLES = st.sampled_from(["user", "system", "assistant", "tool", "developer"])
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(ROLES, ROLES, ROLES, TEXT, JSON_VALUES)},
            optional={
                "content": st.one_of(
                    TEXT,
                    st.text(min_size=500, max_size=2000),
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.just("text"), "text": TEXT},
                            optional={"prompt_cache_breakpoint": BREAKPOINTS},
                        )
                    ),
                    JSON_VALUES,
                ),
                "name": st.one_of(TEXT, JSON_VALUES),
                "tool_calls": JSON_VALUES,
            },
        ),
        max_size=4,
    ),
    JSON_VALUES,
)
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "messages": MESSAGES,
    "max_completion_tokens": st.one_of(NUMBERS, JSON_VALUES),
}


def bodies(fields: dict, base: dict) -> st.SearchStrategy[dict]:
    """A valid ``base`` with some fields replaced by hostile values, plus unknown fields."""
    chosen = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names})
    )
    unknown = st.dictionaries(TEXT, JSON_VALUES, max_size=2)
    return st.tuples(chosen, unknown, st.booleans()).map(
        lambda parts: {**(base if parts[2] else {}), **parts[1], **parts[0]}
    )


COMPLETION_BASE = {"model": "tiny", "prompt": "fuzz", "max_tokens": 2, "ignore_eos": True}
CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2}


def encode(body: object) -> bytes:
    """JSON as Python writes it: NaN and Infinity included, lone surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


def nested(depth: int, open_: str, close: str) -> bytes:
    return (open_ * depth + "1" + close * depth).encode()


RAW_BODIES = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b"123",
            b'"a string"',
            b"{",
            b'{"prompt": "\xff\xfe\xfd"}',
            b'{"prompt": "caf\xc3"}',
            b'\xef\xbb\xbf{"prompt": "bom"}',
            b'{"prompt": "x", "prompt": 5}',
            b'{"prompt": "x", "max_tokens": 1e999}',
            b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
            b'{"prompt": "x", "temperature": NaN}',
            b'{"prompt": "x", "temperature": -Infinity}',
            b'{"prompt": "\\ud800"}',
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            nested(3000, "[", "]"),
            nested(2500, '{"a":', "}"),
            b'{"prompt": ' + nested(2000, "[", "]") + b"}",
            b'{"messages": ' + nested(1500, "[", "]") + b"}",
        ]
    ),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
CONTENT_TYPES = st.sampled_from(
    [
        None,
        "application/json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "",
        "\x7f",
    ]
)


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "base"),
    [
        ("/v1/completions", COMPLETION_FIELDS, COMPLETION_BASE),
        ("/v1/chat/completions", CHAT_FIELDS, CHAT_BASE),
    ],
    ids=["completions", "chat"],
)
def test_hostile_json_bodies_get_4xx_or_a_capped_answer(harness, path, fields, base):
    @fuzz(600)
    @given(body=bodies(fields, base), content_type=CONTENT_TYPES)
    def run(body: dict, content_type: str | None) -> None:
        headers = {} if content_type is None else {"content-type": content_type}
        check(harness.send("POST", path, encode(body), headers))

    run()
    assert_serving_and_clean(harness)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bytes_get_an_openai_400(harness, path):
    @fuzz(300)
    @given(raw=RAW_BODIES, content_type=CONTENT_TYPES)
    def run(raw: bytes, content_type: str | None) -> None:
        headers = {} if content_type is None else {"content-type": content_type}
        response = harness.send("POST", path, raw, headers)
        check(response)
        if len(raw) > MAX_BODY_BYTES:
            assert response.status_code == 413, response.text
            return
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            assert response.status_code == 400, response.text
            return
        if not isinstance(data, dict):
            assert response.status_code == 400, response.text

    run()
    assert_serving_and_clean(harness)


async def chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_body_size_cap_with_and_without_content_length(harness):
    @fuzz(60)
    @given(
        size=st.integers(min_value=MAX_BODY_BYTES - 64, max_value=4 * MAX_BODY_BYTES),
        chunk=st.sampled_from([512, 4096, 65536]),
        chunked=st.booleans(),
    )
    def run(size: int, chunk: int, chunked: bool) -> None:
        prefix = b'{"prompt": "'
        suffix = b'", "max_tokens": 1}'
        filler = b"a" * max(0, size - len(prefix) - len(suffix))
        raw = prefix + filler + suffix
        content = chunks(raw, chunk) if chunked else raw
        response = harness.send("POST", "/v1/completions", content)
        check(response)
        if len(raw) > MAX_BODY_BYTES:
            assert response.status_code == 413, response.text
            assert response.json()["error"]["code"] == "request_too_large"
        else:  # fits the body cap; far too long a prompt for a 1024-token context
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "prompt"

    run()
    assert_serving_and_clean(harness)


def test_max_tokens_cap_is_enforced(harness):
    @fuzz(60)
    @given(max_tokens=st.integers(min_value=-3, max_value=3 * MAX_TOKENS_LIMIT), chat=st.booleans())
    def run(max_tokens: int, chat: bool) -> None:
        body = dict(CHAT_BASE if chat else COMPLETION_BASE, max_tokens=max_tokens)
        body["ignore_eos"] = True
        path = "/v1/chat/completions" if chat else "/v1/completions"
        response = harness.send("POST", path, encode(body))
        check(response)
        if 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == max_tokens
        else:
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "max_tokens"

    run()
    assert_serving_and_clean(harness)


METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "FOO"]
PATHS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/models/tiny",
    "/v1/models/nope",
    "/v1/models/%00",
    "/health",
    "/metrics",
    "/",
    "/v1",
    "/v1/completions/",
    "/v2/completions",
    "/docs",
    "/openapi.json",
]
URL_CHARACTERS = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#?%")
PATH_STRATEGY = st.one_of(
    st.sampled_from(PATHS),
    st.tuples(
        st.sampled_from(["/", "/v1/", "/v1/models/", "/health/", "/v1/chat/"]),
        # not "//x": httpx would read x as a host
        st.text(alphabet=URL_CHARACTERS, max_size=40).filter(lambda t: not t.startswith("/")),
    ).map("".join),
)


def test_every_endpoint_and_method(harness):
    @fuzz(300)
    @given(
        method=st.sampled_from(METHODS),
        path=PATH_STRATEGY,
        raw=st.one_of(st.none(), RAW_BODIES, st.just(encode(COMPLETION_BASE))),
    )
    def run(method: str, path: str, raw: bytes | None) -> None:
        response = harness.send(method, path, raw)
        check(response, method)
        path = unquote(response.request.url.path)
        if path in ("/v1/completions", "/v1/chat/completions") and method not in ("POST",):
            assert response.status_code == 405, response.text
        if path in ("/v1/models", "/health", "/metrics") and method in ("POST", "PUT", "DELETE"):
            assert response.status_code == 405, response.text

    run()
    assert_serving_and_clean(harness)


@pytest.fixture(scope="module", params=[True, False], ids=["metrics-public", "metrics-private"])
def guarded(request) -> Iterator[tuple[Harness, bool]]:
    for harness in make_harness(api_key=API_KEY, metrics_public=request.param):
        yield harness, request.param
        print(f"\nFIGURES fuzz-api-key {{'requests': {harness.num_requests}}}", flush=True)


def test_the_api_key_guards_every_path_but_health(guarded):
    harness, metrics_public = guarded
    public = {"/health", "/metrics"} if metrics_public else {"/health"}

    @fuzz(150)
    @given(
        method=st.sampled_from(METHODS),
        path=PATH_STRATEGY,
        authorization=st.one_of(
            st.none(),
            st.sampled_from(
                [API_KEY, f"Bearer {API_KEY} ", f"bearer {API_KEY}", "Bearer ", f"Basic {API_KEY}"]
            ),
            st.text(
                alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30
            ).map(lambda t: f"Bearer {t}"),
        ),
    )
    def run(method: str, path: str, authorization: str | None) -> None:
        headers = {} if authorization is None else {"authorization": authorization}
        body = encode(COMPLETION_BASE) if method == "POST" else None
        response = harness.send(method, path, body, headers)
        check(response, method)
        served_path = unquote(response.request.url.path)  # after httpx normalised it
        if served_path in public or authorization == f"Bearer {API_KEY}":
            assert response.status_code != 401, response.text
        else:
            assert response.status_code == 401, (method, path, response.text)
            if method != "HEAD":
                assert response.json()["error"]["code"] == "invalid_api_key"

    run()
    engine = harness.engine
    assert not engine.has_unfinished_requests() and engine.kv_cache.npu.num_used == 0
    good = {"authorization": f"Bearer {API_KEY}"}
    for path in ("/v1/models", "/v1/models/tiny", "/metrics", "/health"):
        assert harness.send("GET", path, headers=good).status_code == 200, path
    ok = harness.send("POST", "/v1/completions", encode(COMPLETION_BASE), good)
    assert ok.status_code == 200, ok.text
    assert harness.send("GET", "/metrics").status_code == (200 if metrics_public else 401)
