"""A resize's hand-over through the peer tier, on in-process engines (``Engine.warm_from_peers``):
a new replica pulls a peer's hot blocks into its host tier and serves the prompt from them with
the cache-off tokens; a survivor takes a leaving replica's blocks within its share of the host
tier, keeping its own most recent ones; a failing source moves nothing and breaks nothing."""

from collections.abc import Iterator

import pytest

from replicas.cache_hints import PeerSource
from replicas.config import EngineConfig, KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.events import Tier
from replicas.kv.hashing import block_hashes
from replicas.kv.tiers import peer
from tests.tier_registry import restored_tier_registry
from tests.unit.engine_runs import run

NUM_BLOCKS = 8
PROMPTS = [
    [(11 * i + 7 * p + 5) % 200 for i in range(16 * NUM_BLOCKS)] + [1, 2, p] for p in range(4)
]


def engine(num_host_blocks_ratio: float = 1.0, **offload) -> Engine:
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=48,
            scheduler_config=SchedulerConfig(
                kv_offload_config=KVOffloadConfig(
                    enabled=True, host_memory_ratio=num_host_blocks_ratio, **offload
                )
            ),
        )
    )


@pytest.fixture(scope="module", autouse=True)
def peer_registered() -> Iterator[None]:
    with restored_tier_registry():
        yield


@pytest.fixture(scope="module")
def cold_tokens() -> list[list[int]]:
    cold = Engine(
        EngineConfig(
            model="tiny",
            scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
        )
    )
    return [run(cold, prompt).token_ids for prompt in PROMPTS]


@pytest.fixture(scope="module")
def source() -> Engine:
    """A replica that served every prompt, the first twice (hot)."""
    holder = engine()
    for prompt in [PROMPTS[0], *PROMPTS]:
        run(holder, prompt)
    return holder


def host_tokens(engine: Engine, prompt: list[int]) -> int:
    output = run(engine, prompt)
    engine.check_integrity()
    return output.num_cached_tokens_in(Tier.HOST), output.token_ids


def test_a_new_replica_pulls_its_peers_hot_blocks_and_serves_from_them(source, cold_tokens):
    joining = engine(tiers={"peer": {}})
    hot = source.hot_blocks()
    num_loaded = joining.warm_from_peers([(PeerSource(0, peer.LocalPeer(source), 0), hot)], 10.0)
    assert num_loaded == len(hot) == 4 * NUM_BLOCKS
    assert joining.stats().cache.peer_blocks_loaded == num_loaded
    for prompt, tokens in zip(PROMPTS, cold_tokens):
        assert host_tokens(joining, prompt) == (NUM_BLOCKS * 16, tokens)
    joining.close()


def test_a_survivor_takes_the_leavers_hottest_blocks_within_its_share(source, cold_tokens):
    survivor = engine(0.5, write_through_threshold="immediate", tiers={"peer": {}})  # 24 host
    own = [[(13 * i + 3 * c) % 200 for i in range(16 * 4)] + [9, c] for c in range(1, 7)]
    for prompt in own:  # 6 x 4 blocks, each copied to host: the host tier is full
        run(survivor, prompt)
    assert survivor.kv_cache.host.num_empty == 0
    hot = source.hot_blocks()
    sources = [(PeerSource(0, peer.LocalPeer(source), 0), hot)]
    assert survivor.warm_from_peers(sources, 10.0, max_share=0.5) == 12  # half of 24
    survivor.check_integrity()
    cached = survivor.kv_cache.host.cached_hashes()
    hottest = sorted(hot, key=hot.get, reverse=True)[:12]
    assert set(hottest) <= set(cached)  # the leaver's hottest: the first prompt's blocks first
    assert set(cached) - set(hot) == set(survivor_hashes(own[3:]))  # its own latest stay
    assert host_tokens(survivor, PROMPTS[0]) == (NUM_BLOCKS * 16, cold_tokens[0])
    survivor.close()


def survivor_hashes(prompts: list[list[int]]) -> list[bytes]:
    return [h for prompt in prompts for h in block_hashes(prompt, 16)]


class FailingPeer:
    def export_blocks(self, cache_type, hashes):
        raise ConnectionError("the source died")


def test_a_failing_source_moves_nothing_and_breaks_nothing(source, cold_tokens):
    joining = engine(tiers={"peer": {}})
    hot = source.hot_blocks()
    assert joining.warm_from_peers([(PeerSource(0, FailingPeer(), 0), hot)], 10.0) == 0
    assert joining.kv_cache.host.num_empty == joining.kv_cache.host.num_blocks
    assert host_tokens(joining, PROMPTS[1]) == (0, cold_tokens[1])
    without_peer_tier = engine()
    assert without_peer_tier.warm_from_peers([(PeerSource(0, None, 0), hot)], 10.0) == 0
    joining.close()
    without_peer_tier.close()
