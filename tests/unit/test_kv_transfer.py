import random

import torch

from cluster import LLM, KVOffloadConfig, SamplingParams, SchedulerConfig
from replicas.kv.events import Tier
from replicas.kv.records import BlockCopy, TransferPlan
from replicas.kv.transfer import KVTransfer


def test_batched_copies_move_exactly_the_planned_blocks_per_cache_type():
    npu = {"full": torch.randn(6, 2, 2, 4, 1, 3), "sliding": torch.randn(4, 1, 2, 4, 1, 3)}
    transfer = KVTransfer(npu, {"full": 5, "sliding": 2})
    before = {c: t.clone() for c, t in npu.items()}
    transfer.submit(
        TransferPlan(
            stores=[BlockCopy(4, 0, "full"), BlockCopy(1, 3, "full"), BlockCopy(2, 1, "sliding")],
            loads=[],
        )
    )
    host = transfer.host_caches
    assert torch.equal(host["full"][0], before["full"][4])
    assert torch.equal(host["full"][3], before["full"][1])
    assert torch.equal(host["sliding"][1], before["sliding"][2])
    assert not host["full"][1].any() and not host["sliding"][0].any()  # untouched stay zero
    transfer.submit(
        TransferPlan(
            stores=[],
            loads=[BlockCopy(3, 0, "full"), BlockCopy(0, 5, "full"), BlockCopy(1, 3, "sliding")],
        )
    )
    assert torch.equal(npu["full"][0], before["full"][1])
    assert torch.equal(npu["full"][5], before["full"][4])
    assert torch.equal(npu["full"][2], before["full"][2])
    assert torch.equal(npu["sliding"][3], before["sliding"][2])
    assert transfer.stats.blocks_stored == 3 and transfer.stats.blocks_loaded == 3
    full_bytes, sliding_bytes = (t[0].numel() * 4 for t in npu.values())
    assert transfer.stats.bytes_loaded == 2 * full_bytes + sliding_bytes
    assert len(transfer.poll()) == 2


def test_stores_planned_at_first_write_land_before_a_reset():
    offload = KVOffloadConfig(
        enabled=True, host_memory_ratio=2.0, write_through_threshold="immediate"
    )
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
    assert llm.generate([*prefix, 3], one).num_cached_tokens_in(Tier.HOST) == 320
    llm.check_integrity()
