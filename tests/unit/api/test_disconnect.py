"""A client that leaves aborts its request: every block is freed, streaming or not.

The app is driven at the ASGI level, so the test decides exactly when ``http.disconnect``
arrives: after the first streamed event, or while a non-streaming request is generating.
"""

import asyncio
import json

import pytest

from cluster.api import create_app
from cluster.backend import LocalBackend
from tests.unit.api.conftest import assert_engine_clean, make_engine

LONG = {"prompt": "tell me everything", "max_tokens": 400, "ignore_eos": True}


async def wait_until_clean(engine) -> None:
    for _ in range(400):  # bounded: the abort lands at the engine loop's next gap
        if not engine.has_unfinished_requests() and engine.kv_cache.npu.num_used == 0:
            break
        await asyncio.sleep(0.025)
    assert_engine_clean(engine)


async def call(
    app, body: dict, disconnect: asyncio.Event, sent: list, spec_version: str = "2.3"
) -> None:
    """One POST /v1/completions whose client disconnects when ``disconnect`` is set."""
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=60)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_streaming_client_disconnect_aborts(spec_version):
    engine = make_engine()

    async def scenario() -> None:
        backend = LocalBackend(engine)
        app = create_app(backend)
        disconnect, sent = asyncio.Event(), []

        async def leave_after_first_event() -> None:
            for _ in range(2000):
                if any(m.get("body", b"").startswith(b"data: ") for m in sent):
                    break
                await asyncio.sleep(0.01)
            disconnect.set()

        await asyncio.gather(
            call(app, {**LONG, "stream": True}, disconnect, sent, spec_version),
            leave_after_first_event(),
        )
        assert sent[0]["status"] == 200
        num_events = sum(m.get("body", b"").count(b"data: ") for m in sent)
        assert 1 <= num_events < 100  # it stopped long before max_tokens
        await wait_until_clean(engine)
        await backend.shutdown()

    asyncio.run(scenario())


def test_non_streaming_client_disconnect_aborts():
    engine = make_engine()

    async def scenario() -> None:
        backend = LocalBackend(engine)
        app = create_app(backend)
        disconnect, sent = asyncio.Event(), []

        async def leave_while_generating() -> None:
            for _ in range(2000):
                if engine.has_unfinished_requests() and engine.kv_cache.npu.num_used > 0:
                    break
                await asyncio.sleep(0.01)
            disconnect.set()

        await asyncio.gather(call(app, LONG, disconnect, sent), leave_while_generating())
        assert sent[0]["status"] == 499  # nobody reads it
        await wait_until_clean(engine)
        assert engine.stats().cache.queries == 19  # the request did reach the engine
        await backend.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_a_request_of_several_choices_aborts_every_sequence(stream):
    """n = 3 over a list of 2 prompts: 6 sequences, all aborted when the client leaves."""
    engine = make_engine()

    async def scenario() -> None:
        backend = LocalBackend(engine)
        app = create_app(backend)
        disconnect, sent = asyncio.Event(), []
        body = {**LONG, "prompt": ["tell me everything", "and more"], "n": 3, "stream": stream}

        async def leave_once_all_run() -> None:
            for _ in range(2000):  # every sequence started: the others follow the first output
                if engine.num_unfinished == 6:
                    break
                await asyncio.sleep(0.01)
            disconnect.set()

        await asyncio.gather(call(app, body, disconnect, sent), leave_once_all_run())
        assert engine.stats().cache.queries > 0
        await wait_until_clean(engine)
        await backend.shutdown()

    asyncio.run(scenario())
