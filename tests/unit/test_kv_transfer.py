import random

import torch

from cluster import LLM, KVOffloadConfig, SamplingParams, SchedulerConfig
from replicas.kv_cache_manager import TransferPlan
from replicas.kv_transfer import KVTransfer


def test_batched_copies_move_exactly_the_planned_blocks():
    npu = {"full": torch.randn(6, 2, 2, 4, 1, 3), "sliding": torch.randn(6, 1, 2, 4, 1, 3)}
    transfer = KVTransfer(npu, num_host_blocks=5)
    before = {g: t.clone() for g, t in npu.items()}
    transfer.submit(TransferPlan(stores=[(4, 0), (1, 3)], loads=[]))
    for group in npu:
        assert torch.equal(transfer.host_caches[group][0], before[group][4])
        assert torch.equal(transfer.host_caches[group][3], before[group][1])
        assert not transfer.host_caches[group][1].any()  # untouched host blocks stay zero
    transfer.submit(TransferPlan(stores=[], loads=[(3, 0), (0, 5)]))
    for group in npu:
        assert torch.equal(npu[group][0], before[group][1])
        assert torch.equal(npu[group][5], before[group][4])
        assert torch.equal(npu[group][2], before[group][2])
    assert transfer.stats.blocks_stored == 2 and transfer.stats.blocks_loaded == 2
    block_bytes = sum(t[0].numel() * 4 for t in npu.values())
    assert transfer.stats.bytes_loaded == 2 * block_bytes
    assert len(transfer.poll()) == 2


def test_stores_planned_at_first_write_land_before_a_reset():
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=2.0, write_through_threshold=0)
    llm = LLM(
        "tiny", num_npu_blocks=100, scheduler_config=SchedulerConfig(kv_offload_config=offload)
    )
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    prefix = [random.Random(0).randrange(256) for _ in range(320)]
    llm.generate([*prefix, 1], one)
    assert llm.engine.kv_cache.host.num_used == 0  # nothing left locked in flight
    llm.reset_prefix_cache("all")
    assert llm.generate([*prefix, 2], one).num_cached_tokens == 0
    llm.reset_prefix_cache("npu")
    assert llm.generate([*prefix, 3], one).num_host_cached_tokens == 320
    llm.check_integrity()
