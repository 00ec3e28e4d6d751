"""Batch and interactive requests in the prefix cache: every block only batch requests used is
evicted before an interactive session's, in the NPU and host tiers, with the same output; an
interactive use protects a block for its lifetime; ``service_tier`` and the tenant's default
set the class."""

import random

import pytest

from replicas.cache_hints import CacheHints, parse_service_tier
from replicas.config import EngineConfig, KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.block_pool import BlockPool
from replicas.kv.events import Tier
from replicas.kv.session_gaps import SessionGaps
from replicas.sampling_params import SamplingParams
from tests.unit import engine_runs

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
rng = random.Random(3)
SESSION = [rng.randrange(256) for _ in range(16 * 6 + 5)]  # an agent's context: 6 blocks
DOCS = [[rng.randrange(256) for _ in range(16 * 6 + 3)] for _ in range(8)]  # a batch sweep


def test_batch_blocks_go_first_and_an_interactive_use_protects_a_block_for_its_lifetime():
    now = [0.0]
    pool = BlockPool(6, clock=lambda: now[0], interactive_lifetime_s=10.0)
    ids, _ = pool.allocate(6)
    for i, block_id in enumerate(ids):
        pool.cache(block_id, bytes([i]) * 16)
    pool.mark(ids[:2], batch=False)  # an interactive session's
    pool.mark(ids[2:4], batch=True)  # a batch request's
    pool.mark(ids[4:5], batch=False)
    pool.mark(ids[4:5], batch=True)  # batch after interactive, within the lifetime: protected
    pool.free(ids)  # released oldest first: 0, 1, ... 5
    pool.check_integrity()
    assert pool.eviction_order() == [ids[2], ids[3], ids[0], ids[1], ids[4], ids[5]]
    now[0] = 11.0  # the interactive lifetime has passed: a batch use now makes it batch
    pool.mark([ids[0]], batch=True)
    assert pool.eviction_order()[:3] == [ids[2], ids[3], ids[0]]
    pool.mark([ids[2]], batch=False)  # an interactive hit takes it out of the batch queue
    assert pool.eviction_order()[:2] == [ids[3], ids[0]]
    (taken,), evicted = pool.allocate(1)
    assert taken == ids[3] and evicted == [(ids[3], bytes([3]) * 16)]
    pool.check_integrity()


def engine(write_back: bool = False, **prefix) -> Engine:
    """Host copies made as blocks are written (or, ``write_back``, as the NPU tier evicts them)."""
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=1.0,
        write_through_threshold=0 if write_back else "immediate",
        write_back=write_back,
    )
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=24,
            scheduler_config=SchedulerConfig(
                prefix_cache_config=PrefixCacheConfig(**prefix), kv_offload_config=offload
            ),
        )
    )


def run(replica: Engine, prompt, request_id: str, salt=None, batch=None):
    hints = CacheHints(batch=batch) if batch is not None else None
    return engine_runs.run(replica, prompt, request_id, PARAMS, salt, hints)


def sweep(replica: Engine, salt=None, batch=None) -> None:
    """An interactive session's turn, a sweep over the documents, the session's next turn."""
    for i, doc in enumerate(DOCS):
        run(replica, doc, f"doc{i}", salt, batch)


@pytest.mark.parametrize("tier", [Tier.NPU, Tier.HOST])
def test_a_batch_sweep_leaves_an_interactive_sessions_prefix_cached(tier):
    reference = engine()
    first = run(reference, SESSION, "s0")
    sweep(reference)  # interactive: today's one LRU
    lru = run(reference, SESSION, "s1")
    assert lru.num_cached_tokens < 6 * 16  # the sweep evicted the session (the case to fix)

    replica = engine()
    run(replica, SESSION, "s0")
    if tier is Tier.HOST:  # the session's blocks are on host only
        replica.reset_prefix_cache("npu")
    sweep(replica, batch=True)
    turn = run(replica, SESSION, "s1")
    assert turn.token_ids == first.token_ids == lru.token_ids
    assert turn.num_cached_tokens_in(tier) == turn.num_cached_tokens == 6 * 16


def disk_offload(path) -> KVOffloadConfig:
    """As many host blocks as the 24 NPU ones and 24 disk slots; every block written through to
    host and from host to disk."""
    return KVOffloadConfig(
        enabled=True,
        host_memory_ratio=1.0,
        write_through_threshold="immediate",
        disk_path=str(path),
        disk_bytes=24 * 4 * 2 * 16 * 2 * 64 * 4,  # tiny: 64 KiB a block
    )


def disk_engine(path) -> Engine:
    """24 NPU blocks, as many host blocks and 24 disk slots (``disk_offload``)."""
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=24,
            scheduler_config=SchedulerConfig(kv_offload_config=disk_offload(path)),
        )
    )


@pytest.mark.parametrize("batch", [None, True])
def test_a_batch_sweep_replaces_its_own_disk_blocks_before_an_interactive_sessions(tmp_path, batch):
    """The session's blocks on disk alone; the sweep's 56 blocks pass through 24 disk slots.
    Under one LRU (the sweep interactive) they replace the session's; as batch, their own."""
    replica = disk_engine(tmp_path / str(batch))
    first = run(replica, SESSION, "s0")
    for _ in range(2):  # host stores land, then their disk stores are handed over
        replica.core.flush_transfers(wait=True)
    replica.reset_prefix_cache("npu")
    replica.reset_prefix_cache("host")
    sweep(replica, batch=batch)
    disk = replica.backing["disk"]["full"]
    assert disk.stats().evictions > 0 and disk.stats().blocks_read == 0
    turn = run(replica, SESSION, "s1")
    assert turn.token_ids == first.token_ids
    if batch:  # read from disk into host, served from there
        assert turn.num_cached_tokens_in(Tier.HOST) == turn.num_cached_tokens == 6 * 16
        assert disk.stats().blocks_read == 6
    else:
        assert turn.num_cached_tokens < 6 * 16  # the case the class fixes
    replica.close()


def small_host_engine(host_blocks: int, write_through) -> Engine:
    """24 NPU blocks and ``host_blocks`` host blocks, no write-back by policy."""
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=host_blocks / 24,
        write_through_threshold=write_through,
        write_back=False,
    )
    return Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=24,
            scheduler_config=SchedulerConfig(kv_offload_config=offload),
        )
    )


def test_a_batch_requests_stores_never_evict_an_interactive_sessions_host_blocks():
    replica = small_host_engine(8, "immediate")
    first = run(replica, SESSION, "s0")  # its 6 full blocks written through: 2 host blocks free
    replica.reset_prefix_cache("npu")  # the session's blocks are on host only
    run(replica, DOCS[0], "doc0", batch=True)  # 6 blocks written through in one step
    turn = run(replica, SESSION, "s1")
    assert turn.token_ids == first.token_ids
    assert turn.num_cached_tokens_in(Tier.HOST) == turn.num_cached_tokens == 6 * 16


def test_a_batch_request_moves_an_interactive_sessions_npu_blocks_to_host_never_out():
    replica = small_host_engine(24, 1000)  # nothing reaches host by the policy alone
    first = run(replica, SESSION, "s0")
    long_doc = [rng.randrange(256) for _ in range(16 * 20)]  # 21 of the 24 NPU blocks
    run(replica, long_doc, "sweep", batch=True)  # evicts the session's: nothing else is cached
    turn = run(replica, SESSION, "s1")
    assert turn.token_ids == first.token_ids
    assert turn.num_cached_tokens == 6 * 16 and turn.num_cached_tokens_in(Tier.HOST) >= 16
    interactive = small_host_engine(24, 1000)  # the same, the sweep interactive: evicted
    run(interactive, SESSION, "s0")
    run(interactive, long_doc, "sweep")
    assert run(interactive, SESSION, "s1").num_cached_tokens < 6 * 16  # out of the cache


def test_a_write_back_copy_keeps_the_tenant_and_class_its_evicted_block_had():
    replica = engine(write_back=True, batch_tenants=["nightly"])
    for i, doc in enumerate(DOCS):  # 8 x 7 blocks through 24 NPU blocks: write-backs
        run(replica, doc, f"doc{i}", salt="nightly")
    nightly = replica.kv_cache.tenants.index("nightly")
    stored = [b for b in replica.kv_cache.host.blocks if b.block_hash is not None]
    assert stored and all(b.batch and b.tenant == nightly for b in stored)


def test_a_tenant_default_makes_its_requests_batch_and_a_service_tier_overrides_it():
    replica = engine(batch_tenants=["nightly"])
    run(replica, SESSION, "s0", salt="app")
    sweep(replica, salt="nightly")  # batch by the tenant's default
    assert run(replica, SESSION, "s1", salt="app").num_cached_tokens == 6 * 16
    again = engine(batch_tenants=["nightly"])
    run(again, SESSION, "s0", salt="app")
    sweep(again, salt="nightly", batch=False)  # service_tier: default
    assert run(again, SESSION, "s1", salt="app").num_cached_tokens < 6 * 16


def test_service_tier_values():
    assert parse_service_tier("flex") is True
    assert [parse_service_tier(t) for t in ("auto", "default", "priority", "scale")] == [False] * 4
    assert parse_service_tier(None) is None
    with pytest.raises(ValueError, match="service_tier 'fast'"):
        parse_service_tier("fast")


def test_a_sessions_lifetime_is_learned_from_the_gaps_between_its_turns():
    now = [0.0]
    gaps = SessionGaps(300.0, clock=lambda: now[0], max_sessions=2)
    assert gaps.turn(None) == 300.0 and gaps.turn("s") == 300.0  # no history yet
    for gap in (20.0, 0.5, 40.0):  # 0.5 s: the same turn (n sequences, parallel calls)
        now[0] += gap
        lifetime = gaps.turn("s")
    assert lifetime == 1.5 * 40.5  # its longest gap, from the start of the turn before
    now[0] += 5000.0
    assert gaps.turn("s") == 3600.0  # at most an hour
    gaps.turn("t")
    gaps.turn("u")  # a third session: the least recently seen ("s") is forgotten
    assert len(gaps) == 2 and gaps.turn("s") == 300.0


def test_a_session_protects_its_blocks_for_its_learned_lifetime():
    now = [0.0]
    pool = BlockPool(2, clock=lambda: now[0], interactive_lifetime_s=300.0)
    ids, _ = pool.allocate(2)
    for i, block_id in enumerate(ids):
        pool.cache(block_id, bytes([i]) * 16)
    pool.mark(ids[:1], batch=False, lifetime_s=30.0)  # a fast session's
    pool.mark(ids[1:], batch=False)  # the configured lifetime
    now[0] = 31.0
    pool.mark(ids, batch=True)  # a batch request hits both
    pool.free(ids)
    assert pool.eviction_order() == [ids[0], ids[1]]  # the fast session's is batch now
    assert [pool.blocks[b].batch for b in ids] == [True, False]
    pool.check_integrity()


def test_short_of_blocks_a_batch_request_is_preempted_before_an_interactive_one():
    prompts = {rid: [rng.randrange(256) for _ in range(16 * 3)] for rid in ("batch", "chat")}
    long_output = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs = {}
    for batch_first in (True, False):  # the batch request the older of the two, or the newer
        replica = Engine(EngineConfig(model="tiny", num_npu_blocks=8))  # 2 x 6 blocks needed
        hints = {"batch": CacheHints(batch=True), "chat": None}
        for rid in ("batch", "chat") if batch_first else ("chat", "batch"):
            replica.add_request(rid, prompts[rid], long_output, cache_hints=hints[rid])
        scheduler = replica.core.scheduler
        preempted = set()
        for _ in range(1_000):
            if not replica.has_unfinished_requests():
                break
            for request in replica.step():
                outputs.setdefault((batch_first, request.request_id), []).append(request)
            preempted |= {r.request_id for r in scheduler.waiting if r.num_computed_tokens == 0}
        replica.check_integrity()
        assert replica.stats().num_preemptions > 0 and preempted == {"batch"}
    for rid in ("batch", "chat"):  # the same tokens whoever waited
        assert outputs[True, rid][-1].token_ids == outputs[False, rid][-1].token_ids


def test_an_interactive_request_is_admitted_past_a_batch_one_short_of_blocks():
    replica = Engine(EngineConfig(model="tiny", num_npu_blocks=8))
    long_output = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = {n: [rng.randrange(256) for _ in range(16 * (n % 10))] for n in (2, 4, 5, 12)}
    replica.add_request("running", prompt[4], long_output)  # 4 blocks, then a fifth
    replica.step()
    replica.add_request("batch", prompt[5], long_output, cache_hints=CacheHints(batch=True))
    replica.add_request("later batch", prompt[12], long_output, cache_hints=CacheHints(batch=True))
    replica.add_request("chat", prompt[2], long_output)
    replica.step()  # 3 blocks free: the first batch request waits, and the batch behind it
    scheduler = replica.core.scheduler
    assert [r.request_id for r in scheduler.running] == ["running", "chat"]
    assert [r.request_id for r in scheduler.waiting] == ["batch", "later batch"]
    for _ in range(1_000):
        if not replica.has_unfinished_requests():
            break
        replica.step()
    replica.check_integrity()
