"""Shared prefixes across tenants: the full blocks of a configured prefix are cached without the
tenant's ``cache_salt`` and reused by every tenant, from every tier, with the cache-off output;
nothing after the prefix crosses tenants. The router hashes as the replicas do."""

import random

import pytest

from replicas.config import EngineConfig, KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.events import Tier
from replicas.kv.hashing import block_hashes
from replicas.kv.shared_prefixes import SharedPrefixes
from replicas.model.tokenizer import ByteTokenizer
from tests.unit import engine_runs
from tests.unit.engine_runs import GREEDY

rng = random.Random(5)
SHARED = [rng.randrange(256) for _ in range(16 * 5 + 8)]  # 5 full blocks and 8 tokens more
SUFFIX = [rng.randrange(256) for _ in range(40)]
PROMPT = SHARED + SUFFIX


def run(engine: Engine, prompt: list[int], salt: str | None, request_id: str):
    return engine_runs.run(engine, prompt, request_id, GREEDY, salt)


def engine(disk_path, shared=(SHARED,), caching: bool = True) -> Engine:
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=2.0,
        write_through_threshold="immediate",
        disk_path=str(disk_path),
        disk_bytes=256 * 4 * 2 * 16 * 2 * 64 * 4,
    )
    prefix = PrefixCacheConfig(enabled=caching, shared_prefixes=list(shared))
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=48,
            scheduler_config=SchedulerConfig(
                prefix_cache_config=prefix,
                kv_offload_config=offload if caching else KVOffloadConfig(),
            ),
        )
    )


def test_hashes_are_shared_inside_the_prefix_and_the_tenants_own_after_it():
    shared = 5
    a, b, none = (block_hashes(PROMPT, 16, salt, shared) for salt in ("a", "b", None))
    assert a[:shared] == b[:shared] == none[:shared] == block_hashes(PROMPT, 16)[:shared]
    own = [set(h[shared:]) for h in (a, b, none)]
    assert all(not (x & y) for i, x in enumerate(own) for y in own[i + 1 :])
    assert none == block_hashes(PROMPT, 16)  # no salt: the ordinary chain
    assert block_hashes(PROMPT, 16, "a", 0) == block_hashes(PROMPT, 16, "a")
    assert not set(a) & set(block_hashes(PROMPT, 16, "a"))  # unshared: another chain


def test_the_longest_matching_prefix_counts_and_text_matches_with_or_without_bos():
    tokenizer = ByteTokenizer()
    system = "You are a careful assistant. " * 3  # 87 bytes: 5 full blocks (6 with BOS)
    prefixes = SharedPrefixes.from_config([system[:40], system, [1, 2, 3]], tokenizer)
    with_bos = tokenizer.encode(system + "my question")
    assert prefixes.num_blocks(with_bos, 16) == 88 // 16
    assert prefixes.num_blocks(tokenizer.encode(system, False) + [9] * 50, 16) == 87 // 16
    assert prefixes.num_blocks(tokenizer.encode("something else " * 9), 16) == 0
    assert prefixes.num_blocks([1, 2], 16) == 0 and not SharedPrefixes()
    hashes = prefixes.hashes(with_bos, 16, "t")
    assert hashes == block_hashes(with_bos, 16, "t", 5)
    assert hashes != block_hashes(with_bos, 16, "t")


@pytest.mark.parametrize("tier", [Tier.NPU, Tier.HOST, Tier.DISK])
def test_tenant_b_reuses_the_shared_prefix_and_nothing_of_a_from_every_tier(tmp_path, tier):
    cold = run(engine(tmp_path / "cold", caching=False), PROMPT, None, "cold").token_ids
    first = engine(tmp_path)
    assert run(first, PROMPT, "a", "a").token_ids == cold
    if tier is Tier.HOST:
        first.reset_prefix_cache("npu")
    if tier is Tier.DISK:
        first.close()
    serving = first if tier is not Tier.DISK else engine(tmp_path)
    b = run(serving, PROMPT, "b", "b")
    assert b.token_ids == cold
    assert b.num_cached_tokens == 5 * 16  # not A's suffix
    if tier is Tier.DISK:  # read from disk into host
        assert serving.stats().cache.disk_hits == b.num_cached_tokens_in(Tier.HOST) == 5 * 16
    else:
        assert b.num_cached_tokens_in(tier) == 5 * 16
    request = serving.add_request("probe", PROMPT, GREEDY, cache_salt="b")
    assert request.num_shared_blocks == 5
    assert request.block_hashes == SharedPrefixes([SHARED]).hashes(PROMPT, 16, "b")  # routed
    serving.abort_request("probe")
    assert run(serving, PROMPT, None, "none").num_cached_tokens == 5 * 16  # no salt: shared only
    again = run(serving, PROMPT, "a", "a2")
    assert again.token_ids == cold and again.num_cached_tokens >= 5 * 16
    serving.close()


def test_without_a_configured_prefix_no_block_crosses_tenants(tmp_path):
    replica = engine(tmp_path, shared=())
    run(replica, PROMPT, "a", "a")
    assert run(replica, PROMPT, "b", "b").num_cached_tokens == 0
    replica.close()
