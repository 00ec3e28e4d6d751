"""One in-process engine behind the HTTP app for the API tests, and a scripted backend for the
failures a real engine does not produce on demand (dead replicas, overload, crashes)."""

from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.backend import ClusterStats, LocalBackend, ReplicaStats
from replicas.cache_hints import CacheHints
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.model.tokenizer import ByteTokenizer
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams

MAX_MODEL_LEN = 512
BLOCK_SIZE = 16


def make_engine() -> Engine:
    return Engine(EngineConfig(model="tiny", num_npu_blocks=128, max_model_len=MAX_MODEL_LEN))


def assert_engine_clean(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.npu.num_used == 0
    engine.check_integrity()


@pytest.fixture(scope="package")
def engine() -> Engine:
    return make_engine()


@pytest.fixture(scope="package")
def client(engine: Engine) -> Iterator[TestClient]:
    """The app over the shared engine; one event loop for all tests (the engine loop lives
    in it), so the client is entered once."""
    with TestClient(create_app(LocalBackend(engine), max_tokens_limit=64)) as test_client:
        yield test_client
    assert_engine_clean(engine)  # nothing leaked over all the tests that used it


class NoTemplateTokenizer(ByteTokenizer):
    def apply_chat_template(self, messages: list[dict]) -> str:
        raise ValueError("this model has no chat template; send a plain completion instead")


def _output(prompt: list[int], tokens: list[int], finished: bool) -> RequestOutput:
    text = bytes(tokens).decode()
    return RequestOutput(
        request_id="r",
        prompt_token_ids=prompt,
        token_ids=tokens,
        text=text,
        new_token_ids=tokens[-1:],
        new_text=text[-1:],
        finished=finished,
        finish_reason="length" if finished else None,
        num_cached_tokens=0,
        num_cached_tokens_by_tier=(0, 0, 0),
        arrival_time=0.0,
        first_token_time=0.0,
        finish_time=0.0 if finished else None,
        replica_index=3,
    )


class ScriptedBackend:
    """Answers "ab" (two outputs), or raises ``fail_before`` before the first output or
    ``fail_after`` after it."""

    model_name = "scripted"
    max_model_len = 64

    def __init__(self, tokenizer: ByteTokenizer | None = None) -> None:
        self.resets: list[str] = []
        self.tokenizer = tokenizer or ByteTokenizer()
        self.fail_before: Exception | None = None
        self.fail_after: Exception | None = None
        self.num_live = 1
        self.cache_hints: CacheHints | None = None  # the last request's

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        cache_hints: CacheHints | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.cache_hints = cache_hints
        if self.fail_before is not None:
            raise self.fail_before
        yield _output(prompt_token_ids, [ord("a")], finished=False)
        if self.fail_after is not None:
            raise self.fail_after
        yield _output(prompt_token_ids, [ord("a"), ord("b")], finished=True)

    async def abort(self, request_id: str) -> None:
        pass

    async def num_live_replicas(self) -> int:
        return self.num_live

    async def stats(self) -> ClusterStats:
        return ClusterStats([ReplicaStats(3, self.num_live > 0, None)])

    async def reset_prefix_cache(self, tier: str = "all") -> None:
        self.resets.append(tier)


@pytest.fixture
def scripted() -> ScriptedBackend:
    return ScriptedBackend()


@pytest.fixture
def scripted_client(scripted: ScriptedBackend) -> Iterator[TestClient]:
    app = create_app(scripted)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client
