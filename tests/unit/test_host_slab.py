"""HostSlab: one mapping of the host pools' exact bytes, on hugepages when enough are free."""

import gc
import mmap

import pytest
import torch

from replicas.kv import host_memory
from replicas.kv.host_memory import MAP_HUGETLB, HostSlab, slab_bytes

HUGE = 2 * 2**20
SHAPES = {"full": ((3, 5, 7), torch.float32), "sliding": ((3, 11), torch.bfloat16)}
POOLS = [3 * 5 * 7 * 4, 3 * 11 * 2]


class Pins:
    def __init__(self) -> None:
        self.pinned: list[tuple[int, int]] = []

    def register(self, address: int, num_bytes: int) -> None:
        self.pinned.append((address, num_bytes))

    def unregister(self, address: int) -> None:
        self.pinned = [p for p in self.pinned if p[0] != address]


def fake_meminfo(monkeypatch, free_hugepages: int) -> list[int]:
    info = {"MemAvailable": 2**34, "Hugepagesize": HUGE, "HugePages_Free": free_hugepages}
    monkeypatch.setattr(host_memory, "read_meminfo", lambda: info)
    flags_asked: list[int] = []
    original = host_memory._mmap

    def recording_mmap(num_bytes: int, extra_flags: int):
        flags_asked.append(extra_flags)
        if extra_flags & MAP_HUGETLB:
            return None  # this machine has none reserved: the kernel refuses, as it would
        return original(num_bytes, extra_flags)

    monkeypatch.setattr(host_memory, "_mmap", recording_mmap)
    return flags_asked


def test_slab_bytes_align_each_pool_to_a_page_and_round_the_whole_up():
    assert slab_bytes([]) == 0
    assert slab_bytes([1]) == 4096
    assert slab_bytes([4096, 1]) == 8192
    assert slab_bytes([4097, 1]) == 3 * 4096
    assert slab_bytes([4097, 1], HUGE) == HUGE
    assert slab_bytes([40 * 2**30]) == 40 * 2**30  # not 64 GiB, as a power of two would be


def test_a_slab_on_regular_pages_is_pinned_at_its_exact_size(monkeypatch):
    asked = fake_meminfo(monkeypatch, free_hugepages=0)
    pins = Pins()
    slab = HostSlab(SHAPES, pins)
    assert asked == [0] and not slab.on_hugepages
    assert slab.nbytes == 8192 == slab_bytes(POOLS)
    assert pins.pinned == [(slab.address, 8192)]
    full, sliding = slab.tensors["full"], slab.tensors["sliding"]
    assert full.shape == (3, 5, 7) and full.dtype == torch.float32
    assert sliding.shape == (3, 11) and sliding.dtype == torch.bfloat16
    assert sliding.data_ptr() - full.data_ptr() == 4096 and full.data_ptr() == slab.address
    full.fill_(1.0)
    sliding.fill_(2.0)  # the views do not overlap
    assert (full == 1.0).all() and (sliding == 2.0).all()
    slab.release()
    slab.release()
    assert pins.pinned == []


def test_free_hugepages_are_asked_for_and_a_refusal_falls_back_to_regular_pages(monkeypatch):
    asked = fake_meminfo(monkeypatch, free_hugepages=1)
    slab = HostSlab(SHAPES, Pins())
    assert len(asked) == 2 and asked[0] & MAP_HUGETLB and asked[1] == 0
    assert not slab.on_hugepages and slab.nbytes == 8192
    monkeypatch.setattr(host_memory, "_mmap", lambda n, flags: mmap.mmap(-1, n))
    slab = HostSlab(SHAPES, Pins())
    assert slab.on_hugepages and slab.nbytes == HUGE  # whole hugepages


def test_a_slab_larger_than_available_memory_fails_at_start_up(monkeypatch):
    fake_meminfo(monkeypatch, free_hugepages=0)
    monkeypatch.setattr(host_memory, "read_meminfo", lambda: {"MemAvailable": 4096})
    with pytest.raises(MemoryError, match="of host memory but only"):
        HostSlab(SHAPES, Pins())


def test_hugepage_zeros_is_a_zero_tensor_aligned_to_a_hugepage_that_outlives_its_mapping():
    shape = (10, 2, 32, 16, 64)  # 2.5 MiB of float32: past one hugepage
    tensor = host_memory.hugepage_zeros(shape, torch.float32)
    assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.data_ptr() % host_memory.HUGEPAGE_BYTES == 0
    assert torch.equal(tensor, torch.zeros(shape))
    gc.collect()  # nothing but the tensor holds the mapping now
    tensor[3, 1] = 7.0
    assert tensor.sum().item() == 7.0 * 32 * 16 * 64
    small = host_memory.hugepage_zeros((3, 11), torch.bfloat16)  # under a hugepage: ordinary
    assert torch.equal(small, torch.zeros(3, 11, dtype=torch.bfloat16))


def test_hugepage_zeros_falls_back_to_torch_zeros_when_the_kernel_refuses_the_mapping(
    monkeypatch,
):
    monkeypatch.setattr(host_memory, "_mmap", lambda num_bytes, extra_flags: None)
    tensor = host_memory.hugepage_zeros((3, 2**20), torch.float32)
    assert torch.equal(tensor, torch.zeros(3, 2**20))
