"""Reservation and prefetch at arrival: exact block counts on tiny pools (no tensors), driven
through the real scheduler, and outputs on the built-in model against caching off."""

import random

import pytest

from benchmarks.sim.cost_model import CostModel, HardwareProfile
from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.engine.request import Request, RequestStatus
from replicas.engine.scheduler import Scheduler
from replicas.kv.events import Tier
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import BlockCopy, TransferPlan
from replicas.kv.reservations import ReservationPolicy

BS = 4
P = list(range(100, 112))  # the prefix a waiting request will reuse: 3 blocks
U = list(range(200, 212))  # unrelated, cached after P (evicted after it, LRU)


def cached_run(manager: KVCacheManager, tokens: list[int], name: str) -> None:
    request = Request(name, tokens, SamplingParams(), BS)
    match = manager.match_prefix(request)
    assert manager.allocate_slots(request, request.num_tokens - match.num_blocks * BS, match)
    manager.record_admission(request, match)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    manager.free(request)
    manager.complete_transfer(manager.take_transfer_plan())


def step(scheduler: Scheduler) -> None:
    """One engine step on paper: every scheduled token is computed, decodes get a token."""
    output = scheduler.schedule()
    scheduler.kv_cache.complete_transfer(output.transfer)
    for request, num_new, *_ in output.scheduled:
        request.num_computed_tokens += num_new
        scheduler.kv_cache.cache_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(1)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    scheduler.kv_cache.check_integrity()


def queue_behind_a_long_request(share: float, **manager_options):
    """16 NPU blocks: P cached (oldest), U cached, 10 empty. A running request R then needs 12
    blocks while Q (P + 1 token) waits behind it (one request runs at a time)."""
    manager = KVCacheManager(16, BS, reservations=ReservationPolicy(share), **manager_options)
    cached_run(manager, [*P, 0], "p")
    cached_run(manager, [*U, 0], "u")
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), manager)
    long = Request("r", list(range(300, 340)), SamplingParams(max_tokens=8), BS)
    queued = Request("q", [*P, 7], SamplingParams(max_tokens=1), BS)
    scheduler.add(long)
    scheduler.add(queued)
    return manager, scheduler, long, queued


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_a_queued_request_keeps_its_prefix_only_with_a_reservation(share):
    manager, scheduler, long, queued = queue_behind_a_long_request(share)
    step(scheduler)  # R admitted (10 blocks + room); Q waits, reserved when share > 0
    assert manager.stats.reserved_blocks == (3 if share else 0)
    while not long.is_finished:
        step(scheduler)  # R grows to 12 blocks: evicts 2 cached blocks, the oldest free ones
    assert manager.stats.npu_evictions == 2
    step(scheduler)  # Q admitted
    assert queued.status == RequestStatus.RUNNING or queued.is_finished
    # Without a reservation R evicted P's two deepest blocks (the oldest freed); with one it
    # evicted U's, and Q reuses all of P.
    assert queued.num_cached_tokens == (12 if share else 4)
    assert manager.stats.reserved_blocks == 0 and manager.stats.reservations_dropped == 0
    assert scheduler.num_preemptions == 0


def test_reservations_give_way_before_a_running_request_is_preempted():
    manager, scheduler, long, queued = queue_behind_a_long_request(0.5)
    long.sampling_params.max_tokens = 24  # R now needs every one of the 16 blocks
    step(scheduler)
    assert manager.stats.reserved_blocks == 3
    while not long.is_finished:
        step(scheduler)
    assert manager.stats.reservations_dropped == 1 and scheduler.num_preemptions == 0
    assert manager.stats.reserved_blocks == 0
    step(scheduler)
    assert queued.num_cached_tokens == 0  # P gave way to R


def test_prefetched_blocks_are_exactly_the_host_only_matched_ones():
    manager = KVCacheManager(
        16,
        BS,
        num_host_blocks=8,
        write_through_threshold="immediate",
        reservations=ReservationPolicy(0.5),
    )
    cached_run(manager, [*P, 0], "p")  # stored to host at once (threshold 0)
    manager.reset_prefix_cache("npu")  # P now lives on host only
    host_ids = [manager.host.lookup(h) for h in Request("x", P, SamplingParams(), BS).block_hashes]
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), manager)
    long = Request("r", list(range(300, 320)), SamplingParams(max_tokens=3), BS)
    queued = Request("q", [*P, 7], SamplingParams(max_tokens=1), BS)
    scheduler.add(long)
    scheduler.add(queued)
    output = scheduler.schedule()  # R admitted, Q reserved: its 3 host blocks are prefetched
    prefetches = [c for c in output.transfer.loads if c.prefetch]
    assert sorted(c.src for c in prefetches) == sorted(host_ids)
    assert len(output.transfer.loads) == 3 and manager.stats.prefetched_blocks == 3
    assert manager.views.usage()["full"].of(Tier.HOST).num_used == 3  # locked until the loads land
    manager.complete_transfer(output.transfer)
    for request, num_new, *_ in output.scheduled:
        request.num_computed_tokens += num_new
        manager.cache_blocks(request)
        request.append_output_token(1)
    while not long.is_finished:
        step(scheduler)
    output = scheduler.schedule()  # Q admitted: adopts the prefetched blocks, loads nothing
    assert output.transfer.loads == []
    assert queued.num_host_cached_tokens == 12 and queued.num_npu_cached_tokens == 0
    assert manager.stats.prefetched_blocks_used == 3 and manager.stats.host_hits == 12
    manager.complete_transfer(output.transfer)
    manager.check_integrity()


@pytest.mark.parametrize("prefetch", [True, False])
def test_without_prefetch_a_reservation_holds_the_leading_npu_blocks_only(prefetch):
    manager = KVCacheManager(
        16,
        BS,
        num_host_blocks=8,
        write_through_threshold="immediate",
        reservations=ReservationPolicy(0.5, prefetch=prefetch),
    )
    cached_run(manager, [*P, 0], "p")  # stored to host at once (threshold 0)
    manager.reset_prefix_cache("npu")
    cached_run(manager, [*P[:BS], 0], "p0")  # P's first block back on NPU; blocks 2-3 host-only
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), manager)
    scheduler.add(Request("r", list(range(300, 320)), SamplingParams(max_tokens=3), BS))
    scheduler.add(Request("q", [*P, 7], SamplingParams(max_tokens=1), BS))
    output = scheduler.schedule()  # R admitted, Q reserved
    prefetches = [c for c in output.transfer.loads if c.prefetch]
    assert manager.stats.reserved_blocks == (3 if prefetch else 1)
    assert len(prefetches) == manager.stats.prefetched_blocks == (2 if prefetch else 0)
    manager.complete_transfer(output.transfer)
    manager.check_integrity()


def test_aborting_a_reserved_request_releases_its_reservation():
    manager, scheduler, _, queued = queue_behind_a_long_request(0.5)
    step(scheduler)
    assert manager.reservations.has("q")
    scheduler.finish(queued, RequestStatus.FINISHED_ABORTED)
    assert not manager.reservations.has("q") and manager.stats.reserved_blocks == 0
    manager.check_integrity()


def test_a_prefetch_load_costs_the_step_what_any_load_costs():
    """The engine's forward pass waits for the step's whole plan (``KVTransfer``), prefetch
    loads included, so the simulator charges them to the step like the batch's own loads."""
    profile = HardwareProfile.load("h200-llama8b")
    cost = CostModel(profile, block_size=16, token_scale=1.0)
    loads = [BlockCopy(i, i, "full", prefetch=True) for i in range(64)]
    quiet = cost.step_timing([], TransferPlan([], []))
    busy = cost.step_timing([], TransferPlan([], loads))
    block_bytes = 16 * profile.kv_bytes_per_token
    copy_s = profile.transfer_latency_s + 64 * block_bytes / profile.h2d_bytes_per_s
    assert busy.first_s == pytest.approx(quiet.first_s + copy_s)
    assert busy.tail_s == quiet.tail_s
    eager = cost.step_timing([], TransferPlan([], [c._replace(prefetch=False) for c in loads]))
    assert eager == busy
    half = [c._replace(prefetch=False) for c in loads[:32]]
    mixed = cost.step_timing([], TransferPlan([], [*half, *loads[32:]]))
    assert mixed == busy  # one batched copy, whichever requests its blocks are for


def test_outputs_with_reservations_and_prefetch_equal_caching_off():
    rng = random.Random(3)
    prefix = [rng.randrange(256) for _ in range(64)]
    queued = [*prefix, 9, 8, 7]
    long = [rng.randrange(256) for _ in range(70)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    cold = LLM(
        "tiny",
        scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
    )
    reference = [o.token_ids for o in cold.generate([long, queued], params)]
    llm = LLM(
        "tiny",
        num_npu_blocks=24,
        scheduler_config=SchedulerConfig(
            max_num_seqs=1,
            prefix_cache_config=PrefixCacheConfig(reservation_share=0.5),
            kv_offload_config=KVOffloadConfig(
                enabled=True, host_memory_ratio=4.0, write_through_threshold="immediate"
            ),
        ),
    )
    llm.generate([*prefix, 1], params)  # the prefix, stored to host as it is written
    llm.reset_prefix_cache("npu")  # and gone from the NPU tier
    assert llm.engine.kv_cache.npu.lookup(Request("x", prefix, params, 16).block_hashes[0]) is None
    outputs = llm.generate([long, queued], params)  # queued waits behind long: prefetched
    assert [o.token_ids for o in outputs] == reference
    stats = llm.stats().cache
    assert stats.prefetched_blocks == stats.prefetched_blocks_used == 4  # the 64-token prefix
    assert outputs[1].num_cached_tokens_in(Tier.HOST) == 64 and stats.reserved_blocks == 0
    llm.check_integrity()
    assert llm.engine.kv_cache.npu.num_used == 0
