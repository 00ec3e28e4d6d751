"""The trace simulator drives the real cache, scheduler and router code: exact hit counts on a
hand-made trace, the same counts as the real engine, and every peer policy routes validly.

No timing is asserted. Traces use one token block per hash id (T = block size = 16).
"""

import random
from dataclasses import asdict, replace

import pytest

from benchmarks.sim.clairvoyant import ClairvoyantPolicy, clairvoyant
from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.metrics import ideal_ttft_s
from benchmarks.sim.peers import PEERS
from benchmarks.sim.reuse import reuse_by_split
from benchmarks.sim.simulator import CLAIRVOYANT, STRATA, SimConfig, Simulator
from benchmarks.sim.trace import TraceRecord, TraceRequest, expand, unbounded_cached_blocks
from cluster import LLM, KVOffloadConfig, SamplingParams, SchedulerConfig
from replicas.kv.retention import PolicyContext

BLOCK = 16
PROFILE = HardwareProfile.load("cpu-tiny")

# (hash ids, input_length in trace tokens): one id = 512 trace tokens = 16 prompt tokens here.
HAND_TRACE = [
    ((1, 2, 3), 1536),  # 48 tokens: nothing cached yet                      -> 0 hit tokens
    ((1, 2, 4), 1536),  # blocks 1, 2 cached                                    -> 32
    ((1, 2, 3, 5), 1792),  # 56 tokens, 3 full blocks: 1, 2, 3 cached           -> 48
    ((6,), 512),  # 16 tokens: one block, but the last token is always computed -> 0
    ((1, 2, 3), 1536),  # 1, 2, 3 cached, yet the last block holds the last token -> 32
]
HAND_QUERIES = 48 + 48 + 56 + 16 + 48
HAND_HITS = 0 + 32 + 48 + 0 + 32


def records(trace: list[tuple[tuple[int, ...], int]], output_length: int = 64) -> list:
    return [
        TraceRecord(1000.0 * i, length, output_length, ids) for i, (ids, length) in enumerate(trace)
    ]


def simulate(requests: list[TraceRequest], **options: object) -> Simulator:
    config = SimConfig(block_size=BLOCK, tokens_per_hash_id=BLOCK, token_scale=1.0, **options)
    simulator = Simulator(config, CostModel(PROFILE, BLOCK, 1.0), requests)
    simulator.record = simulator.run()
    return simulator


def test_expansion_shares_token_exact_prefixes():
    a, b, c, d, e = expand(records(HAND_TRACE), BLOCK)
    assert [len(r.prompt_token_ids) for r in (a, b, c, d, e)] == [48, 48, 56, 16, 48]
    assert a.prompt_token_ids[:32] == b.prompt_token_ids[:32]
    assert a.prompt_token_ids[32:] != b.prompt_token_ids[32:]
    assert c.prompt_token_ids[:48] == a.prompt_token_ids == e.prompt_token_ids
    assert a.max_tokens == 2 and a.arrival_s == 0.0 and b.arrival_s == 1.0


@pytest.mark.parametrize("sequential", [True, False])
def test_hand_made_trace_gives_hand_computed_hits(sequential: bool):
    sim = simulate(
        expand(records(HAND_TRACE), BLOCK),
        data_parallel_size=1,
        num_npu_blocks=64,
        sequential=sequential,
    )
    stats = sim.engines[0].kv_cache.stats
    assert (stats.queries, stats.hits, stats.npu_hits, stats.host_hits) == (
        HAND_QUERIES,
        HAND_HITS,
        HAND_HITS,
        0,
    )
    assert sim.record["hit_rate"] == HAND_HITS / HAND_QUERIES
    assert sim.record["num_finished"] == len(HAND_TRACE)


def test_ideal_bound_prefills_each_prompt_after_its_unbounded_cached_prefix():
    trace = records(HAND_TRACE + [((7, 2), 1024)])  # block 2 after another parent: a miss
    cached, num_prefixes = unbounded_cached_blocks(trace)
    assert cached == [0, 2, 3, 0, 3, 0]
    assert num_prefixes == 8  # 1, 1-2, 1-2-3, 1-2-4, 1-2-3-5, 6, 7, 7-2
    # One hash id = 16 simulated tokens, each standing for 32 trace tokens.
    cost = CostModel(PROFILE, BLOCK, 32.0)
    p = PROFILE
    # Simulated tokens (the cached prefix is capped one token short of the prompt).
    expected = [(48, 0), (16, 32), (8, 48), (16, 0), (1, 47), (32, 0)]
    times = ideal_ttft_s(trace, cost, BLOCK)
    assert times == pytest.approx(
        [p.step_fixed_s + cost.prefill_s(32 * n, 32 * c) for n, c in expected]
    )
    long = records([((8,), p.max_model_len + 1)])
    assert ideal_ttft_s(long, cost, BLOCK) == []  # skipped, as a run skips it


def test_strata_routes_by_the_kv_events_of_the_replicas():
    # dp 2: every request sharing blocks 1, 2 follows them to replica 0; the cold request 3
    # ties (idle, cached nowhere) and goes to the replica that has taken no new blocks yet.
    sim = simulate(
        expand(records(HAND_TRACE), BLOCK), data_parallel_size=2, num_npu_blocks=64, sequential=True
    )
    assert sim.record["cache_hits_tokens"] == HAND_HITS
    assert sim.record["agent"]["requests_per_replica"] == [4, 1]
    assert sim.record["agent"]["num_event_gaps"] == 0


def test_the_overload_bound_spreads_a_burst_that_shares_one_prefix():
    # Blocks 1-7 are cached on one replica first; then 12 requests sharing them arrive
    # together, each with its own last block. Unbounded, the holder takes them all (locality
    # weights); at factor 2 the others share the burst.
    shared = tuple(range(1, 8))
    trace = [TraceRecord(0.0, 4096, 16, (*shared, 99))]
    trace += [TraceRecord(5.0 + 0.001 * i, 4096, 16, (*shared, 100 + i)) for i in range(12)]
    per_replica = {}
    for factor in (0.0, 2.0):
        sim = simulate(
            expand(trace, BLOCK),
            data_parallel_size=3,
            num_npu_blocks=256,
            scoring_profile="locality",
            overload_factor=factor,
        )
        per_replica[factor] = sim.record["agent"]["requests_per_replica"]
    assert sorted(per_replica[0.0]) == [0, 0, 13]
    assert min(per_replica[2.0]) >= 3 and sum(per_replica[2.0]) == 13  # 5, 4, 4


def random_trace(num_requests: int, seed: int) -> list[TraceRecord]:
    """Conversations that grow turn by turn and a few shared system prompts."""
    rng = random.Random(seed)
    next_id = 100
    sessions: list[list[int]] = []
    out = []
    for i in range(num_requests):
        if sessions and rng.random() < 0.6:
            ids = rng.choice(sessions)
            ids.extend(range(next_id, next_id + rng.randint(1, 2)))
        else:
            ids = [rng.randint(1, 3), *range(next_id, next_id + rng.randint(0, 2))]
            sessions.append(ids)
        next_id += 3
        length = len(ids) * 512 - rng.choice([0, 0, 200])
        out.append(TraceRecord(float(i), length, rng.choice([32, 64, 96]), tuple(ids[:6])))
    return out


COUNTERS = ("queries", "hits", "npu_hits", "host_hits")


def real_engine_counters(
    requests: list[TraceRequest],
    num_npu_blocks: int,
    model: str = "tiny",
    offload: KVOffloadConfig | None = None,
    names: tuple[str, ...] = COUNTERS,
) -> dict[str, int]:
    offload = offload or KVOffloadConfig(enabled=True, host_memory_ratio=1.0, write_back=True)
    with LLM(
        model,
        block_size=BLOCK,
        num_npu_blocks=num_npu_blocks,
        max_model_len=num_npu_blocks * BLOCK,
        scheduler_config=SchedulerConfig(kv_offload_config=offload),
    ) as llm:
        for request in requests:
            params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
            llm.generate(request.prompt_token_ids, params)
        llm.check_integrity()
        stats = llm.stats().cache
        counters = {k: getattr(stats, k) for k in names}
        by_type = {name: asdict(c) for name, c in stats.by_cache_type.items()}
        return {**counters, "by_cache_type": by_type, "usage": llm.stats().cache_types}


@pytest.mark.parametrize(("model", "sliding_window"), [("tiny", None), ("tiny-hybrid", 64)])
def test_simulator_and_real_engine_count_the_same_hits(model: str, sliding_window: int | None):
    # A small NPU tier (eviction) and a host tier with write-back (host hits), dp 1; the hybrid
    # model adds a sliding-window cache type with its own pools and out-of-window releases.
    requests = expand(random_trace(40, seed=3), BLOCK)
    real = real_engine_counters(requests, num_npu_blocks=12, model=model)
    sim = simulate(
        requests,
        data_parallel_size=1,
        num_npu_blocks=12,
        host_memory_ratio=1.0,
        write_back=True,
        sequential=True,
        sliding_window=sliding_window,
    )
    kv_cache = sim.engines[0].kv_cache
    simulated = {
        k: getattr(kv_cache.stats, k) for k in ("queries", "hits", "npu_hits", "host_hits")
    }
    simulated["by_cache_type"] = {n: asdict(c) for n, c in kv_cache.stats.by_cache_type.items()}
    simulated["usage"] = kv_cache.views.usage()
    assert simulated == real
    assert real["npu_hits"] > 0 and real["host_hits"] > 0  # both tiers were exercised
    if sliding_window is not None:
        sliding = real["by_cache_type"]["sliding"]
        assert sliding["blocks_freed_out_of_window"] > 0 and sliding["blocks_loaded"] > 0


@pytest.mark.parametrize("policy", [STRATA, *PEERS])
def test_every_policy_routes_to_valid_replicas(policy: str):
    requests = expand(random_trace(40, seed=5), BLOCK)
    config = SimConfig(
        policy=policy,
        data_parallel_size=3,
        block_size=BLOCK,
        token_scale=1.0,
        num_npu_blocks=24,
        host_memory_ratio=1.0,
    )
    simulator = Simulator(config, CostModel(PROFILE, BLOCK, 1.0), requests)
    chosen = []
    route = simulator.agent.route

    def recording_route(request, now):
        replica = route(request, now)
        chosen.append(replica)
        return replica

    simulator.agent.route = recording_route
    record = simulator.run()
    assert len(chosen) == len(requests) == record["num_finished"]
    assert all(isinstance(r, int) and 0 <= r < 3 for r in chosen)
    assert 0.0 <= record["hit_rate"] <= 1.0


def test_simulator_and_real_engine_count_the_same_disk_hits(tmp_path):
    # NPU 12 blocks, host 12, disk 20 (of 64 KiB, the tiny model's block): host evictions go
    # to disk with write-back and later requests read them back, in both.
    requests = expand(random_trace(40, seed=3), BLOCK)
    disk_bytes = 20 * 65536
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=1.0,
        write_back=True,
        disk_path=str(tmp_path),
        disk_bytes=disk_bytes,
    )
    names = (*COUNTERS, "disk_hits", "disk_blocks_loaded")
    counters = real_engine_counters(requests, 12, offload=offload, names=names)
    real = {k: counters[k] for k in names}
    sim = simulate(
        requests,
        data_parallel_size=1,
        num_npu_blocks=12,
        host_memory_ratio=1.0,
        write_back=True,
        disk_memory_gb=disk_bytes / 2**30,
        sequential=True,
    )
    simulated = {k: getattr(sim.engines[0].kv_cache.stats, k) for k in names}
    assert simulated == real
    assert real["disk_hits"] > 0


def test_clairvoyant_tracker_stores_what_the_trace_requests_again_within_its_window():
    now = [0.5]
    tracker = ClairvoyantPolicy(PolicyContext(8), {b"a": [1.0, 5.0]}, lambda: now[0], window_s=1.0)
    assert tracker.should_store(b"a", 0, host_full=True)  # next at 1.0: 0.5 s ahead
    now[0] = 2.0
    assert not tracker.should_store(b"a", 0, host_full=False)  # next at 5.0: 3 s ahead
    tracker.window_s = 3.0
    assert tracker.should_store(b"a", 0, host_full=True)
    now[0] = 5.0
    assert not tracker.should_store(b"a", 3, host_full=False)  # never again
    assert not tracker.should_store(b"b", 3, host_full=False)  # in no prompt (decoded tokens)
    with pytest.raises(ValueError, match="window"):
        clairvoyant({}, lambda: 0.0, window_s=0.0)


def test_clairvoyant_bound_serves_what_write_back_serves_with_fewer_stores():
    # One request a second; 12 NPU blocks, a host tier that never evicts. With a window longer
    # than the trace the bound stores every evicted block that is requested again, so it serves
    # from host what write-back serves, storing fewer; with a window shorter than any gap
    # between requests it stores nothing at all (every store of the bound, promoted blocks'
    # included, is decided at eviction), so the host tier serves nothing.
    trace = [replace(r, timestamp_ms=1000.0 * i) for i, r in enumerate(random_trace(60, seed=5))]
    requests = expand(trace, BLOCK)

    def run(**options: object) -> dict:
        options = {"num_npu_blocks": 12, "host_memory_ratio": 8.0, **options}
        return simulate(requests, data_parallel_size=1, **options).engines[0].kv_cache.stats

    write_back, default = run(write_back=True), run()
    assert write_back.host_evictions == 0 and write_back.write_backs > 0
    bound = run(retention=CLAIRVOYANT, clairvoyant_window_s=1e6)
    assert bound.host_hits == write_back.host_hits > default.host_hits
    assert 0 < bound.blocks_stored < write_back.blocks_stored
    blind = run(retention=CLAIRVOYANT, clairvoyant_window_s=0.5)
    assert (blind.blocks_stored, blind.host_hits) == (0, 0) and default.blocks_stored > 0


def test_reuse_splits_count_each_new_block_once_with_its_next_request():
    trace = [
        TraceRecord(0.0, 1536, 8, (1, 2, 3)),
        TraceRecord(10_000.0, 1536, 8, (1, 2, 4)),  # shares 1, 2: block 4 is its only new one
        TraceRecord(1_000_000.0, 1536, 8, (1, 2, 3)),  # all seen: no new block
    ]
    # Blocks 1 and 1-2 come back 10 s later, 1-2-3 after 1000 s, 1-2-4 never.
    within_300 = reuse_by_split(trace, window_s=300.0)
    assert within_300["blocks from the prompt's end"] == {0: (2, 0.0), 1: (1, 1.0), 2: (1, 1.0)}
    assert within_300["follow-up (shares more than block 0)"] == {False: (3, 2 / 3), True: (1, 0.0)}
    within_1000 = reuse_by_split(trace, window_s=1000.0)
    assert within_1000["blocks from the prompt's end"][0] == (2, 0.5)
