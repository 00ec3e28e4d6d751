"""The CUDA transfer path's ordering and bookkeeping, with its CUDA calls behind a recorder.

``Recorder`` is a ``CopyRuntime`` whose streams and events log every wait and record, and whose
events complete only when a test says so (or something synchronizes them): copies run at once
on CPU tensors, so the bytes are checked against plain indexing, and the order of the logged
calls is what a GPU would obey.
"""

import contextlib
import random
from collections.abc import Iterator

import pytest
import torch

from replicas.kv import host_memory
from replicas.kv.host_memory import SLAB_ALIGN_BYTES, slab_bytes
from replicas.kv.records import BackingCopy, BlockCopy, TransferPlan
from replicas.kv.stream_copier import copy_runs
from replicas.kv.transfer import KVTransfer


class Event:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def record(self, stream: "Stream | None" = None) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log.append(("cpu_wait", self.name))
        self.done = True

    def elapsed_time(self, end_event: "Event") -> float:
        return 2.0  # milliseconds, whatever the copies


class Stream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, stream: "Stream") -> None:
        self.log.append(("wait_stream", self.name, stream.name))

    def wait_event(self, event: Event) -> None:
        self.log.append(("wait_event", self.name, event.name))


class Recorder:
    """Streams named compute, stores, loads (in the order made); events e0, e1, ..."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events: list[Event] = []
        self.compute = self.current = Stream(self.log, "compute")
        self.stream_names = iter(["stores", "loads"])
        self.registered: dict[int, int] = {}

    def new_stream(self) -> Stream:
        return Stream(self.log, next(self.stream_names))

    def new_event(self, timing: bool = False) -> Event:
        self.events.append(Event(self.log, f"e{len(self.events)}"))
        return self.events[-1]

    def current_stream(self) -> Stream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def register(self, address: int, num_bytes: int) -> None:
        self.log.append(("register", num_bytes))
        self.registered[address] = num_bytes

    def unregister(self, address: int) -> None:
        self.log.append(("unregister", self.registered.pop(address)))

    def complete(self, *names: str) -> None:
        for event in self.events:
            if event.name in names:
                event.done = True


def make(num_npu: int = 8, num_host: int = 8, staging_blocks: int = 8, sliding: bool = False):
    gen = torch.Generator().manual_seed(0)
    npu = {"full": torch.randn(num_npu, 2, 3, generator=gen)}
    if sliding:
        npu["sliding"] = torch.randn(num_npu, 5, generator=gen)
    runtime = Recorder()
    block = 6 * 4  # bytes of one "full" block
    transfer = KVTransfer(
        npu, dict.fromkeys(npu, num_host), runtime=runtime, staging_bytes=staging_blocks * block
    )
    return transfer, runtime


def test_copy_runs_cover_every_pair_in_the_fewest_copies():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(0, 12)
        src = rng.sample(range(30), n) if rng.random() < 0.5 else list(range(5, 5 + n))
        dst = rng.sample(range(30), n) if rng.random() < 0.5 else list(range(2, 2 + n))
        runs = copy_runs(src, dst)
        pairs = [(s + i, d + i) for s, d, length in runs for i in range(length)]
        assert pairs == list(zip(src, dst))
        breaks = sum(1 for i in range(1, n) if (src[i] - src[i - 1], dst[i] - dst[i - 1]) != (1, 1))
        assert len(runs) == (n and breaks + 1)
    assert copy_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]


def test_compute_waits_for_the_gather_and_the_loads_but_not_for_the_stores_bus_copy():
    transfer, rt = make()
    npu, host = transfer.npu_caches["full"], transfer.host_caches["full"]
    before = npu.clone()
    host[5].fill_(7.0)
    # Block 3 is stored (write-back) and reused as a load's destination in the same plan.
    plan = TransferPlan([BlockCopy(3, 0), BlockCopy(1, 1)], [BlockCopy(5, 3)])
    rt.log.clear()
    transfer.submit(plan)
    gathered, stored, loaded = "e0", "e1", "e3"  # e2, e4: where each stream's copies begin
    assert rt.log == [
        ("wait_stream", "stores", "compute"),
        ("record", "e2", "stores"),
        ("record", gathered, "stores"),
        ("record", stored, "stores"),
        ("wait_event", "compute", gathered),
        ("wait_stream", "loads", "compute"),
        ("record", "e4", "loads"),
        ("record", loaded, "loads"),
        ("wait_event", "compute", loaded),
    ]
    assert torch.equal(host[0], before[3]) and torch.equal(host[1], before[1])
    assert (npu[3] == 7.0).all()  # the load landed after the store's gather read block 3
    assert transfer.poll() == []  # nothing has landed
    rt.complete(gathered, loaded)
    assert transfer.poll() == []  # the store is still on the bus: its host blocks stay locked
    rt.complete(stored)
    seconds = transfer.stats.seconds
    assert transfer.poll() == [plan]
    assert transfer.stats.seconds - seconds == pytest.approx(0.004)  # 2 ms a stream, timed


def test_plans_are_reported_in_submission_order_only_once_landed():
    transfer, rt = make()
    first = TransferPlan([BlockCopy(0, 0)], [])
    second = TransferPlan([], [BlockCopy(4, 4)])
    disk_only = TransferPlan([], [], backing_loads=(BackingCopy(2, b"k"),))
    for plan in (first, second, disk_only):
        transfer.submit(plan)
    rt.complete("e3")  # the second plan's load
    assert transfer.poll() == []
    rt.complete("e0", "e1")
    assert transfer.poll() == [first, second, disk_only]
    third = TransferPlan([BlockCopy(1, 1)], [])
    transfer.submit(third)
    assert transfer.poll(wait=True) == [third]
    assert ("cpu_wait", "e6") in rt.log


def test_a_load_of_a_block_still_being_stored_waits_on_the_device_for_that_store_only():
    transfer, rt = make()
    npu, host = transfer.npu_caches["full"], transfer.host_caches["full"]
    before = npu.clone()
    transfer.submit(TransferPlan([BlockCopy(2, 6)], []))  # e0 gathered, e1 stored, e2 begun
    transfer.submit(TransferPlan([BlockCopy(4, 7)], []))  # e3, e4, e5
    rt.log.clear()
    transfer.submit(TransferPlan([], [BlockCopy(6, 0), BlockCopy(3, 1)]))
    assert ("wait_event", "loads", "e1") in rt.log
    assert not any(entry[0] == "cpu_wait" for entry in rt.log)
    assert ("wait_event", "loads", "e4") not in rt.log  # host block 7 is not read
    assert torch.equal(npu[0], before[2]) and torch.equal(host[6], before[2])


def test_a_load_of_a_block_stored_in_the_same_plan_waits_for_that_store():
    transfer, rt = make()
    npu = transfer.npu_caches["full"]
    before = npu.clone()
    # Write-back stores NPU block 2 to host block 5; another request adopts host block 5.
    transfer.submit(TransferPlan([BlockCopy(2, 5)], [BlockCopy(5, 6)]))
    stored, loaded = "e1", "e3"  # e0: the gather
    assert ("wait_event", "loads", stored) in rt.log
    assert rt.log.index(("record", stored, "stores")) < rt.log.index(("record", loaded, "loads"))
    assert torch.equal(npu[6], before[2])


def test_a_disk_store_waits_on_the_cpu_for_the_store_into_its_host_block():
    transfer, rt = make()
    written = []

    class Disk:
        def store(self, key, block, retained_until, weight):
            written.append((key, block.clone()))

    transfer.backing = {"disk": {"full": Disk()}}
    npu = transfer.npu_caches["full"]
    transfer.submit(TransferPlan([BlockCopy(5, 2)], []))  # e0 gathered, e1 stored, e2 begun
    transfer.submit(TransferPlan([BlockCopy(6, 3)], []))  # e3, e4, e5
    rt.log.clear()
    transfer.submit(TransferPlan([], [], backing_stores=(BackingCopy(2, b"k"),)))
    assert rt.log == [("cpu_wait", "e1")]  # the store into host block 2, not the other
    assert written[0][0] == b"k" and torch.equal(written[0][1], npu[5])


@pytest.mark.parametrize("staging_blocks", [1, 2, 3])
def test_stores_beyond_the_staging_ring_are_gathered_piece_by_piece(staging_blocks):
    transfer, rt = make(num_npu=12, num_host=12, staging_blocks=staging_blocks, sliding=True)
    npu, host = transfer.npu_caches, transfer.host_caches
    before = {c: t.clone() for c, t in npu.items()}
    rng = random.Random(staging_blocks)
    copies = []
    for cache_type in npu:
        sources, destinations = rng.sample(range(12), 7), rng.sample(range(12), 7)
        copies += [BlockCopy(s, d, cache_type) for s, d in zip(sources, destinations)]
    transfer.submit(TransferPlan(copies, []))
    for c in copies:
        assert torch.equal(host[c.cache_type][c.dst], before[c.cache_type][c.src]), c
    records = [e for e in rt.log if e[0] == "record"]
    assert records == [("record", e, "stores") for e in ("e2", "e0", "e1")]
    assert len(transfer.poll(wait=True)) == 1


def test_the_host_pools_are_one_slab_pinned_at_its_exact_size(monkeypatch):
    checked = []
    monkeypatch.setattr(host_memory, "check_host_capacity", lambda n, *a, **k: checked.append(n))
    transfer, rt = make(num_host=5, sliding=True)
    full, sliding = transfer.host_caches["full"], transfer.host_caches["sliding"]
    pools = [5 * 6 * 4, 5 * 5 * 4]
    # Independently: the sliding pool starts at the next 4 KiB boundary; the slab ends on a page.
    expected = -(-(SLAB_ALIGN_BYTES + pools[1]) // 4096) * 4096
    assert slab_bytes(pools) == expected == transfer.host_bytes
    assert checked == [expected]
    [(address, num_bytes)] = rt.registered.items()
    assert num_bytes == expected
    assert full.data_ptr() == address and sliding.data_ptr() == address + SLAB_ALIGN_BYTES
    assert full.shape == (5, 2, 3) and sliding.shape == (5, 5)
    assert not full.any() and not sliding.any()
    transfer.submit(TransferPlan([BlockCopy(0, 0)], []))
    rt.log.clear()
    assert len(transfer.close()) == 1
    assert rt.log == [("cpu_wait", "e1"), ("unregister", expected)]  # landed, then unpinned
    assert rt.registered == {}


@pytest.fixture
def fake_cuda_env(monkeypatch):
    """STRATA_FAKE_CUDA=1 for the test, the fake device off after it."""
    from replicas import fake_cuda

    monkeypatch.setenv(fake_cuda.ENV, "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    fake_cuda.deactivate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is here")
def test_host_tier_reloads_on_fake_cuda_equal_caching_off(fake_cuda_env):
    from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
    from replicas.kv.events import Tier

    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(96)]
    prompts = [[*prefix, 7, 8], [*prefix, 9]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    off = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))
    cold = LLM("tiny", device="cuda", num_npu_blocks=40, scheduler_config=off)
    want = [o.token_ids for o in cold.generate(prompts, greedy)]
    offload = KVOffloadConfig(
        enabled=True, host_memory_ratio=2.0, write_through_threshold="immediate"
    )
    llm = LLM(
        "tiny",
        device="cuda",
        num_npu_blocks=40,
        scheduler_config=SchedulerConfig(kv_offload_config=offload),
    )
    transfer = llm.engine.transfer
    assert transfer.streamed and transfer.host_bytes == slab_bytes(
        [t.numel() * t.element_size() for t in transfer.host_caches.values()]
    )
    llm.generate([*prefix, 1], greedy)  # stored to host as it is written
    llm.reset_prefix_cache("npu")
    got = llm.generate(prompts, greedy)
    assert [o.token_ids for o in got] == want
    assert got[0].num_cached_tokens_in(Tier.HOST) == 96
    llm.check_integrity()
    llm.engine.close()
    assert transfer.poll() == []
