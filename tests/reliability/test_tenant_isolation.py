"""Tenant isolation: requests with different ``cache_salt`` never share a cached block, over
HTTP on one engine (the strongest case: both tenants hit the same cache), and the block hash
behind it is collision-resistant."""

import random
import uuid
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.api import create_app
from cluster.backend import LocalBackend
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.kv.hashing import block_hashes, hash_block
from tests.reliability.conftest import UvicornThread

BLOCK_SIZE = 16
PROMPT = "Tenant A's confidential system prompt: never reveal the launch date of project X. " * 2


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[UvicornThread, Engine]]:
    engine = Engine(EngineConfig(model="tiny", num_npu_blocks=256, block_size=BLOCK_SIZE))
    running = UvicornThread(create_app(LocalBackend(engine)))
    try:
        yield running, engine
    finally:
        running.close()


def cached(url: str, prompt: str, salt: str | None, chat: bool = False) -> int:
    body: dict = {"max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    if chat:
        body["messages"] = [{"role": "system", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    answer = httpx.post(url + path, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_no_cached_token_crosses_tenants(server, chat):
    running, engine = server
    url = running.url
    prompt = f"{uuid.uuid4().hex} {PROMPT}"  # nobody has cached it yet
    num_tokens = len(prompt.encode()) + 1  # BOS + bytes
    assert cached(url, prompt, "tenant-a", chat) == 0
    reused = cached(url, prompt, "tenant-a", chat)
    assert reused > 0 and (chat or reused == num_tokens - 1)  # all but the last token
    for other in ("tenant-b", "tenant-a ", "tenant-", "TENANT-A", None):
        assert cached(url, prompt, other, chat) == 0, other  # not even a shared first block
    assert cached(url, prompt, "tenant-b", chat) == reused  # B now has its own copy
    assert cached(url, prompt, None, chat) == reused
    assert cached(url, prompt, "tenant-a", chat) == reused
    engine.check_integrity()


@settings(
    max_examples=15,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    salts=st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=3, unique=True),
    words=st.text(min_size=40, max_size=120),
)
def test_random_salts_over_http(server, salts, words):
    running, _ = server
    prompt = f"{uuid.uuid4().hex}{words}"
    for salt in salts:
        assert cached(running.url, prompt, salt) == 0, salt
    for salt in salts:
        assert cached(running.url, prompt, salt) > 0, salt


TOKENS = st.lists(st.integers(min_value=0, max_value=2**31), min_size=BLOCK_SIZE, max_size=64)
SALTS = st.one_of(st.none(), st.text(max_size=8))


@settings(max_examples=400, database=None, deadline=None)
@given(a=st.tuples(SALTS, TOKENS), b=st.tuples(SALTS, TOKENS))
def test_block_hashes_differ_unless_salt_and_prefix_match(a, b):
    (salt_a, tokens_a), (salt_b, tokens_b) = a, b
    hashes_a = block_hashes(tokens_a, BLOCK_SIZE, salt_a)
    hashes_b = block_hashes(tokens_b, BLOCK_SIZE, salt_b)
    for i, (ha, hb) in enumerate(zip(hashes_a, hashes_b)):
        same = (
            salt_a == salt_b
            and tokens_a[: (i + 1) * BLOCK_SIZE] == tokens_b[: (i + 1) * BLOCK_SIZE]
        )
        assert (ha == hb) == same, (i, salt_a, salt_b)


def test_no_collision_over_many_random_prompts_and_salts():
    """About 90,000 blocks: random prompts under random salts, and one prompt under 2,000
    salts (equal prefixes must never collide across salts)."""
    rng = random.Random(1234)
    seen: dict[bytes, tuple] = {}
    shared = [rng.randrange(258) for _ in range(4 * BLOCK_SIZE)]
    cases = [(f"salt-{i}", shared) for i in range(2000)]
    cases += [(None, shared)]
    for _ in range(20_000):
        salt = rng.choice([None, f"t{rng.randrange(50)}"])
        tokens = [rng.randrange(258) for _ in range(rng.randrange(1, 8) * BLOCK_SIZE)]
        cases.append((salt, tokens))
    num_blocks = 0
    for salt, tokens in cases:
        for i, digest in enumerate(block_hashes(tokens, BLOCK_SIZE, salt)):
            key = (salt, tuple(tokens[: (i + 1) * BLOCK_SIZE]))
            assert seen.setdefault(digest, key) == key, "block hash collision"
            num_blocks += 1
    assert num_blocks > 80_000
    # Length-prefixed salts: no salt/token split of the same bytes hashes alike.
    assert hash_block(None, [1] * BLOCK_SIZE, "ab") != hash_block(None, [1] * BLOCK_SIZE, "a")
    assert hash_block(None, [0] * BLOCK_SIZE, "") != hash_block(None, [0] * BLOCK_SIZE, None)
