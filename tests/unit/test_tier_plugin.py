"""A tier added as one file (``tests/unit/memo_tier.py``) plus its registry entry, chosen by name
in a config, serves requests: blocks written to it by the host tier's rules come back through
it with the output of a cache-off engine, counted, announced and sized like any tier's."""

from collections.abc import Iterator

import pytest

from replicas.config import EngineConfig, KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.events import Tier, tiers
from replicas.kv.tiers import registry
from tests.tier_registry import restored_tier_registry
from tests.unit.engine_runs import run

PROMPT = [(7 * i + 3) % 200 for i in range(16 * 6)] + [5, 6, 7]  # 6 full blocks and a tail
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model's block: layers x K,V x ... (float32)


@pytest.fixture(scope="module")
def memo() -> Iterator[Tier]:
    """The tier's registry entry, as a built-in has one (name -> module, imported and
    registered on first use); the registry is as before after the module."""
    with restored_tier_registry():
        registry.BUILT_IN["memo"] = "tests.unit.memo_tier"
        try:
            yield Tier(registry.plugin("memo").traits.name)
        finally:
            del registry.BUILT_IN["memo"]


def engine(**offload) -> Engine:
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=48,
            scheduler_config=SchedulerConfig(
                kv_offload_config=KVOffloadConfig(
                    enabled=True,
                    host_memory_ratio=2.0,
                    write_through_threshold="immediate",
                    **offload,
                )
            ),
        )
    )


def test_a_tier_from_one_file_serves_requests_chosen_by_name(memo):
    cold = Engine(
        EngineConfig(
            model="tiny",
            scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
        )
    )
    expected = run(cold, PROMPT).token_ids
    warm = engine(tiers={"memo": {"bytes": 64 * BLOCK_BYTES}})
    assert memo in tiers() and not memo.traits.pooled
    assert list(warm.backing) == ["memo"] and warm.kv_cache.handover_tier is None
    warm.kv_cache.views.enable_events()
    assert run(warm, PROMPT).token_ids == expected
    warm.core.flush_transfers(wait=True)
    warm.core.flush_transfers(wait=True)  # a landed host store plans its store behind host
    stored = {e.block_hash for e in warm.kv_cache.views.drain_events() if e.tier == memo}
    assert len(stored) >= 6
    warm.reset_prefix_cache("npu")
    warm.reset_prefix_cache("host")
    output = run(warm, PROMPT, "again")  # read back from the memo tier through host
    assert output.token_ids == expected and output.num_cached_tokens == 6 * 16
    stats = warm.stats()
    assert stats.cache.memo_blocks_loaded >= 6 and stats.cache.counters()["memo_reloads"] == 1
    assert stats.cache.hits_by_tier()[memo] >= 6 * 16
    assert stats.cache_types["full"].of(memo).num_blocks > 0
    assert stats.backing["memo"]["full"].blocks_read >= 6
    with pytest.warns(DeprecationWarning, match="Engine.backing"):
        assert warm.disk is None
    with pytest.warns(DeprecationWarning, match="EngineStats.backing"):
        assert stats.disk == {}
    with pytest.warns(DeprecationWarning, match="read_s"):
        assert stats.reload_costs.disk_read_s == 0.0 and "memo" in stats.reload_costs.read_s
    warm.close()


def test_a_tier_behind_host_is_checked_at_start_up(memo):
    with pytest.raises(ValueError, match=r"tiers\['memo'\].*bytes"):
        KVOffloadConfig(enabled=True, host_memory_ratio=1.0, tiers={"memo": {}})
    with pytest.raises(ValueError, match=r"tiers\['memo'\] needs the host tier"):
        KVOffloadConfig(tiers={"memo": {"bytes": 1 << 20}})
    with pytest.raises(ValueError, match="unknown KV tier 'nope'"):
        KVOffloadConfig(enabled=True, host_memory_ratio=1.0, tiers={"nope": {"bytes": 1}})
    with pytest.raises(ValueError, match=r"tiers\['memo'\].bytes leaves the replica no memo block"):
        engine(tiers={"memo": {"bytes": BLOCK_BYTES // 2}})
