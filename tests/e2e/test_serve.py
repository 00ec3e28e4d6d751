"""`strata serve` as users run it: one process on an embedded Ray, used with the openai client."""

import signal
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_serve_shutdown import free_port, start_serve, stop_and_check

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"  # what configs/default.yaml serves
SYSTEM = (
    "You are a helpful assistant for a travel agency. You answer questions about geography, "
    "capitals, cities and countries in one short sentence, and you never make up facts."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default config on a free port; stopped at the end as a terminal's Ctrl-C stops it
    (SIGINT to the process group), within 10 s and with every Ray process gone."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--config", "configs/default.yaml", "--num-cpus", "2"]
    process = start_serve(args, log, port)
    yield f"http://127.0.0.1:{port}"
    stop_and_check(process, signal.SIGINT, to_group=True, log=log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_and_chat_streaming_and_not(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    completion = client.completions.create(
        model=MODEL,
        prompt="Hello, Strata",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert completion.usage.completion_tokens == 8
    pieces = [
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=MODEL,
            prompt="Hello, Strata",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if chunk.choices
    ]
    assert "".join(pieces) == completion.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content


def test_repeated_prompt_reports_cached_tokens_and_metrics_per_replica(client, server):
    prompt = "A long shared system prompt for every tenant of Strata. " * 6
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    time.sleep(0.5)  # the replica's KV events reach the router
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert cached == second.usage.prompt_tokens - 1 > 0  # all but the last, always computed

    with urllib.request.urlopen(f"{server}/metrics", timeout=30) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    queries = {
        s.labels["replica"]: s.value for s in families["strata_prefix_cache_queries"].samples
    }
    assert set(queries) == {"0", "1"}
    hits = sum(s.value for s in families["strata_prefix_cache_hits"].samples)
    assert hits >= cached
    routed = {s.labels["replica"]: s.value for s in families["strata_router_requests"].samples}
    assert sum(routed.values()) >= 6


def test_the_real_model_answers_and_a_follow_up_reuses_the_system_prompt(client):
    question = {"role": "user", "content": "What is the capital of France?"}
    first = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, question],
        max_tokens=24,
        temperature=0,
    )
    answer = first.choices[0].message.content
    assert "Paris" in answer, answer
    time.sleep(0.5)  # the replica's KV events reach the router
    follow_up = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": SYSTEM},
            question,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And of Italy?"},
        ],
        max_tokens=24,
        temperature=0,
    )
    assert "Rome" in follow_up.choices[0].message.content, follow_up.choices[0].message.content
    cached = follow_up.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 - 16 > 0


def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    ok = client.completions.create(model=MODEL, prompt="still serving", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
