"""KVTransfer on a real GPU: direct copies between the pinned host slab and device blocks, on
side streams; stores overlap the compute stream, loads are waited for.

The same algorithm's ordering and bookkeeping run on every machine in
``tests/unit/test_stream_copier.py`` (its CUDA calls behind a recorder) and through the fake
device of ``STRATA_FAKE_CUDA``; these tests check what only a GPU shows: that the device obeys
the waits, that the slab is pinned, and that stores do not hold the compute stream back.
"""

import random

import pytest
import torch

from replicas.kv.host_memory import slab_bytes
from replicas.kv.records import BlockCopy, TransferPlan
from replicas.kv.transfer import KVTransfer
from tests.gpu.devices import CUDA_ONLY, HAS_CUDA

CACHE_TYPES = {"full": (64, 96), "sliding": (32, 48)}  # NPU blocks, host blocks
FULL_BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4


def make_transfer(device: str, **kwargs) -> KVTransfer:
    generator = torch.Generator().manual_seed(0)
    npu = {
        "full": torch.randn(64, 2, 2, 16, 2, 8, generator=generator).to(device),
        "sliding": torch.randn(32, 1, 2, 16, 2, 8, generator=generator).to(device),
    }
    num_host_blocks = {name: host for name, (_, host) in CACHE_TYPES.items()}
    return KVTransfer(npu, num_host_blocks, **kwargs)


def random_stores(rng: random.Random, per_cache_type: int) -> list[BlockCopy]:
    copies = []
    for cache_type, (num_npu, num_host) in CACHE_TYPES.items():
        sources = rng.sample(range(num_npu), per_cache_type)
        destinations = rng.sample(range(num_host), per_cache_type)
        copies += [BlockCopy(s, d, cache_type) for s, d in zip(sources, destinations)]
    return copies


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("staging_blocks", [None, 5], ids=["ring-holds-the-plan", "small-ring"])
def test_stores_then_loads_of_the_same_blocks_are_byte_equal_and_ordered(device, staging_blocks):
    options = {} if staging_blocks is None else {"staging_bytes": staging_blocks * FULL_BLOCK_BYTES}
    transfer = make_transfer(device, **options)
    npu = transfer.npu_caches
    before = {name: t.clone() for name, t in npu.items()}
    stores = random_stores(random.Random(1), 12)
    transfer.submit(TransferPlan(stores, []))
    # The compute stream overwrites the stored blocks at once: only the gather is waited for.
    for copy in stores:
        npu[copy.cache_type][copy.src].fill_(-1.0)
    # Loads of the host blocks just stored, before anything was polled: they see the stored bytes.
    transfer.submit(TransferPlan([], [BlockCopy(c.dst, c.src, c.cache_type) for c in stores]))
    seen = {name: t.clone() for name, t in npu.items()}  # on the compute stream, no synchronize
    landed = transfer.poll(wait=True)
    torch.cuda.synchronize()
    assert [len(p.stores) + len(p.loads) for p in landed] == [24, 24]
    for cache_type in CACHE_TYPES:
        assert torch.equal(seen[cache_type], before[cache_type]), cache_type
        for copy in (c for c in stores if c.cache_type == cache_type):
            host_block = transfer.host_caches[cache_type][copy.dst]
            assert torch.equal(host_block, before[cache_type][copy.src].cpu()), copy


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_the_compute_stream_waits_for_loads(device):
    num_blocks, block_floats = 256, 2**18  # 256 MiB: still on the bus when submit returns
    npu = {"full": torch.zeros(num_blocks, block_floats, device=device)}
    transfer = KVTransfer(npu, {"full": num_blocks})
    host = transfer.host_caches["full"]
    host.copy_(torch.randn(num_blocks, block_floats))
    order = list(range(num_blocks))
    random.Random(3).shuffle(order)
    transfer.submit(TransferPlan([], [BlockCopy(h, n) for n, h in enumerate(order)]))
    seen = npu["full"].clone()  # enqueued on the compute stream right after submit
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), host[order])
    assert len(transfer.poll(wait=True)) == 1


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_a_store_does_not_hold_the_compute_stream_back(device):
    num_blocks, block_floats = 128, 2**19  # 256 MiB: about 5 ms on the bus, 0.1 ms to gather
    npu = {"full": torch.randn(num_blocks, block_floats, device=device)}
    transfer = KVTransfer(npu, {"full": num_blocks})
    transfer.submit(TransferPlan([BlockCopy(i, i) for i in range(num_blocks)], []))
    done = torch.cuda.Event()
    npu["full"].fill_(0.0)  # the next forward pass overwrites what the store reads
    done.record()
    done.synchronize()
    assert len(transfer.poll(wait=True)) == 1
    assert not transfer.host_caches["full"].eq(0).all()  # the store read the bytes before


def host_allocations() -> int:
    stats = torch.cuda.host_memory_stats()
    for key in ("allocations.allocated", "num_host_alloc", "active_requests.allocated"):
        if key in stats:
            return stats[key]
    raise AssertionError(f"no pinned allocation counter in {sorted(stats)}")


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_the_host_pools_are_one_registered_slab_of_their_exact_size(device):
    before = host_allocations()
    transfer = make_transfer(device)
    assert host_allocations() == before  # not torch's power-of-two pinned allocator
    pools = [t.numel() * t.element_size() for t in transfer.host_caches.values()]
    assert transfer.host_bytes == slab_bytes(pools) < 2 * sum(pools) + 8192
    for tensor in transfer.host_caches.values():
        assert tensor.device.type == "cpu" and tensor.is_pinned()
    transfer.close()


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_transfers_allocate_no_pinned_memory(device):
    transfer = make_transfer(device, staging_bytes=8 * FULL_BLOCK_BYTES)
    rng = random.Random(4)

    def traffic(num_plans: int) -> None:
        for _ in range(num_plans):
            stores = random_stores(rng, rng.randrange(1, 20))
            loads = [
                BlockCopy(c.dst, rng.randrange(CACHE_TYPES[c.cache_type][0]), c.cache_type)
                for c in stores
            ]
            transfer.submit(TransferPlan(stores, []))
            transfer.poll()
            transfer.submit(TransferPlan([], loads))
            transfer.poll()
        transfer.poll(wait=True)

    traffic(3)  # first use of the CUDA context, streams and allocators
    torch.cuda.synchronize()
    before = host_allocations()
    traffic(40)
    torch.cuda.synchronize()
    assert host_allocations() == before


@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU and a CUDA build of torch")
@pytest.mark.cuda
def test_host_reloads_on_cuda_give_the_greedy_outputs_of_caching_off():
    from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
    from replicas.kv.events import Tier

    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(160)]
    prompts = [[*prefix, 7, 8], [*prefix, 9]]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    off = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))
    want = [
        o.token_ids
        for o in LLM("tiny", device="cuda", scheduler_config=off).generate(prompts, greedy)
    ]
    offload = KVOffloadConfig(
        enabled=True, host_memory_ratio=2.0, write_through_threshold="immediate"
    )
    llm = LLM(
        "tiny",
        device="cuda",
        num_npu_blocks=64,
        scheduler_config=SchedulerConfig(kv_offload_config=offload),
    )
    llm.generate([*prefix, 1], greedy)
    llm.reset_prefix_cache("npu")
    got = llm.generate(prompts, greedy)
    assert [o.token_ids for o in got] == want
    assert got[0].num_cached_tokens_in(Tier.HOST) == 160
    llm.check_integrity()
