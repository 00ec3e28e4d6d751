"""KVTransfer on CUDA: side-stream copies through pinned staging blocks allocated once.

Each test also runs with ``device="cpu"``: the same staged algorithm (``staged=True``) on CPU
tensors, where every copy lands when issued, so its bookkeeping is checked without a GPU.
"""

import random

import pytest
import torch

from replicas.kv.records import BlockCopy, TransferPlan
from replicas.kv.transfer import KVTransfer
from tests.gpu.devices import CUDA_ONLY, DEVICES, HAS_CUDA, synchronize

CACHE_TYPES = {"full": (64, 96), "sliding": (32, 48)}  # NPU blocks, host blocks
FULL_BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4


def make_transfer(device: str, **kwargs) -> KVTransfer:
    generator = torch.Generator().manual_seed(0)
    npu = {
        "full": torch.randn(64, 2, 2, 16, 2, 8, generator=generator).to(device),
        "sliding": torch.randn(32, 1, 2, 16, 2, 8, generator=generator).to(device),
    }
    num_host_blocks = {name: host for name, (_, host) in CACHE_TYPES.items()}
    return KVTransfer(npu, num_host_blocks, staged=True, **kwargs)


def random_stores(rng: random.Random, per_cache_type: int) -> list[BlockCopy]:
    copies = []
    for cache_type, (num_npu, num_host) in CACHE_TYPES.items():
        sources = rng.sample(range(num_npu), per_cache_type)
        destinations = rng.sample(range(num_host), per_cache_type)
        copies += [BlockCopy(s, d, cache_type) for s, d in zip(sources, destinations)]
    return copies


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staging_blocks", [None, 5], ids=["ring-holds-the-plan", "small-ring"])
def test_stores_then_loads_of_the_same_blocks_are_byte_equal_and_ordered(device, staging_blocks):
    options = {} if staging_blocks is None else {"staging_bytes": staging_blocks * FULL_BLOCK_BYTES}
    transfer = make_transfer(device, **options)
    npu = transfer.npu_caches
    before = {name: t.clone() for name, t in npu.items()}
    stores = random_stores(random.Random(1), 12)
    transfer.submit(TransferPlan(stores, []))
    # The compute stream overwrites the stored blocks at once: it must wait for the store's reads.
    for copy in stores:
        npu[copy.cache_type][copy.src].fill_(-1.0)
    # Loads of the host blocks just stored, before anything was polled: they see the stored bytes.
    transfer.submit(TransferPlan([], [BlockCopy(c.dst, c.src, c.cache_type) for c in stores]))
    seen = {name: t.clone() for name, t in npu.items()}  # on the compute stream, no synchronize
    landed = transfer.poll(wait=True)
    synchronize(device)
    assert [len(p.stores) + len(p.loads) for p in landed] == [24, 24]
    for cache_type in CACHE_TYPES:
        assert torch.equal(seen[cache_type], before[cache_type]), cache_type
        for copy in (c for c in stores if c.cache_type == cache_type):
            host_block = transfer.host_caches[cache_type][copy.dst]
            assert torch.equal(host_block, before[cache_type][copy.src].cpu()), copy
    assert transfer.stats.blocks_stored == transfer.stats.blocks_loaded == 24
    assert transfer.poll(wait=True) == []


@pytest.mark.parametrize("device", DEVICES)
def test_many_plans_in_flight_reuse_the_ring_and_land_in_order(device):
    transfer = make_transfer(device, staging_bytes=8 * FULL_BLOCK_BYTES)  # 8 "full" blocks
    npu, host = transfer.npu_caches, transfer.host_caches
    before = {name: t.clone() for name, t in npu.items()}
    rng = random.Random(2)
    stores = []
    for i in range(8):  # 6 + 6 blocks each, to host blocks 0..47 of each cache type
        sources = {t: rng.sample(range(CACHE_TYPES[t][0]), 6) for t in CACHE_TYPES}
        plan = TransferPlan(
            [BlockCopy(s, 6 * i + k, t) for t in CACHE_TYPES for k, s in enumerate(sources[t])], []
        )
        transfer.submit(plan)
        stores.append(plan)
    for t in CACHE_TYPES:
        npu[t].zero_()
    loads = [
        TransferPlan([], [BlockCopy(c.dst, c.src, c.cache_type) for c in plan.stores])
        for plan in stores
    ]
    for plan in loads:
        transfer.submit(plan)
    seen = {name: t.clone() for name, t in npu.items()}
    assert transfer.poll(wait=True) == [*stores, *loads]
    synchronize(device)
    for plan in stores:
        for copy in plan.stores:
            assert torch.equal(
                host[copy.cache_type][copy.dst], before[copy.cache_type][copy.src].cpu()
            )
            assert torch.equal(seen[copy.cache_type][copy.src], before[copy.cache_type][copy.src])


@pytest.mark.parametrize("device", DEVICES)
def test_the_compute_stream_waits_for_loads(device):
    # On CUDA, 256 MiB: the last pieces' bus copies are still running when submit returns.
    num_blocks, block_floats = (256, 2**18) if device == "cuda" else (16, 2**10)
    npu = {"full": torch.zeros(num_blocks, block_floats, device=device)}
    transfer = KVTransfer(npu, {"full": num_blocks}, staged=True)
    host = transfer.host_caches["full"]
    host.copy_(torch.randn(num_blocks, block_floats))
    order = list(range(num_blocks))
    random.Random(3).shuffle(order)
    transfer.submit(TransferPlan([], [BlockCopy(h, n) for n, h in enumerate(order)]))
    seen = npu["full"].clone()  # enqueued on the compute stream right after submit
    synchronize(device)
    assert torch.equal(seen.cpu(), host[order])
    assert len(transfer.poll(wait=True)) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_host_pools_and_staging_blocks_are_pinned_on_cuda(device):
    from cluster import LLM, KVOffloadConfig, SchedulerConfig

    transfer = make_transfer(device)
    pinned = device == "cuda"
    assert transfer.staging_tensors()
    for tensor in [*transfer.host_caches.values(), *transfer.staging_tensors()]:
        assert tensor.device.type == "cpu" and tensor.is_pinned() == pinned
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=2.0)
    llm = LLM(
        "tiny-hybrid",
        device=device,
        num_npu_blocks=32,
        scheduler_config=SchedulerConfig(kv_offload_config=offload),
    )
    engine_transfer = llm.engine.transfer
    assert engine_transfer.staged == pinned  # CPU engines copy block to block instead
    for tensor in [*engine_transfer.host_caches.values(), *engine_transfer.staging_tensors()]:
        assert tensor.is_pinned() == pinned
    for cache in engine_transfer.npu_caches.values():
        assert cache.device.type == device


def pinned_handouts() -> int | None:
    """Pinned blocks handed out by torch's host allocator so far (None without CUDA)."""
    if not HAS_CUDA:
        return None
    stats = torch.cuda.host_memory_stats()
    for key in ("active_requests.allocated", "allocations.allocated", "num_host_alloc"):
        if key in stats:
            return stats[key]
    raise AssertionError(f"no pinned allocation counter in {sorted(stats)}")


@pytest.mark.parametrize("device", DEVICES)
def test_transfers_allocate_no_pinned_memory(device, monkeypatch):
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
    synchronize(device)
    staging = [t.data_ptr() for t in transfer.staging_tensors()]
    requests: list[str] = []
    original_empty, original_pin = torch.empty, torch.Tensor.pin_memory

    def empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            requests.append("torch.empty(pin_memory=True)")
        return original_empty(*args, **kwargs)

    def pin_memory(self, *args, **kwargs):
        requests.append("Tensor.pin_memory()")
        return original_pin(self, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    handed_out = pinned_handouts()
    traffic(40)
    synchronize(device)
    assert requests == []
    assert pinned_handouts() == handed_out
    assert [t.data_ptr() for t in transfer.staging_tensors()] == staging


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_transfer_rejects_unstaged_cuda_copies(device):
    npu = {"full": torch.zeros(4, 8, device=device)}
    with pytest.raises(ValueError, match="staging"):
        KVTransfer(npu, {"full": 4}, staged=False)
