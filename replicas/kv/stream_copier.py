"""Host-tier copies on CUDA: direct copies between the pinned host slab and device blocks, on two
side streams, so that a step waits for the loads it reads and never for a store's bus copy.

One plan, per cache type::

    store  npu[src] --gather (device)--> staging --D2H, one copy per run of host ids--> host[dst]
    load   host[src] --H2D, one copy per run contiguous on both sides--> npu[dst]

No CPU memcpy is on either path: the host pool is pinned memory the device reads and writes
itself (``replicas.kv.host_memory.HostSlab``). Streams and events::

    compute  ──forward N──┬───────────────wait(G)──wait(L)──forward N+1──►
    stores                └wait─gather─G─D2H ... D2H─S──────────────────►   (overlaps N+1)
    loads                        (after G)  └─wait(S of its host blocks)─H2D─L──►

  * both side streams first wait for the compute stream, so a store reads the KV the last
    forward pass wrote, and a load overwrites no block that pass still reads;
  * the compute stream waits for the stores' gather (``G``: a device copy, a small share of the
    bus copy) and the loads' event (``L``), never for the stores' bus copies (``S``). So a block
    a store reads may be reallocated and overwritten at once: its bytes are in the staging
    ring by then. The ring is reused in stream order, so a gather never overwrites staging a
    bus copy still reads; stores beyond the ring's capacity wait for the copies ahead of them;
  * a load that reads a host block whose store is still on the bus waits for that store's
    event on the device (the load stream), not on the CPU;
  * a plan has landed when its events have completed; until ``poll`` reports it, the cache
    manager keeps its host blocks locked (a store's destinations, a load's sources), so no
    later plan or disk read writes them. ``land_stores_into`` waits on the CPU for the stores
    into some host blocks (a disk store reads them on the CPU).

``CopyRuntime`` puts every stream, event and pinning call behind one small interface: the real
one is ``torch.cuda`` (``TorchCudaRuntime``), and tests give a recorder that runs the copies on
CPU tensors and lets a test decide when each event completes.
"""

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from replicas.kv.records import BlockCopy, TransferPlan

STORE_STAGING_BYTES = 256 * 2**20
"""Device staging per cache type for stores' gathers: the stores in flight beyond it wait for
the bus copies ahead of them (and so does the next forward pass, for their gather)."""


class CopyEvent(Protocol):
    def record(self, stream: "CopyStream | None" = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: "CopyEvent") -> float:
        """Milliseconds from this event to ``end_event`` (both made with ``timing``)."""
        ...


class CopyStream(Protocol):
    def wait_stream(self, stream: "CopyStream") -> None: ...

    def wait_event(self, event: CopyEvent) -> None: ...


class CopyRuntime(Protocol):
    """The CUDA calls the copier makes: streams, events, and pinning memory it allocated."""

    def new_stream(self) -> CopyStream: ...

    def new_event(self, timing: bool = False) -> CopyEvent: ...

    def current_stream(self) -> CopyStream:
        """The compute stream: the one the forward pass runs on."""
        ...

    def use(self, stream: CopyStream) -> contextlib.AbstractContextManager[None]:
        """Issue the work inside on ``stream``."""
        ...

    def register(self, address: int, num_bytes: int) -> None:
        """Pin host memory for direct device copies (``cudaHostRegister``)."""
        ...

    def unregister(self, address: int) -> None: ...


class TorchCudaRuntime:
    """``CopyRuntime`` on ``torch.cuda``. On the fake device of ``STRATA_FAKE_CUDA`` streams and
    events are its own (complete at once) and nothing is pinned: there is no driver."""

    def __init__(self, device: torch.device) -> None:
        from replicas import fake_cuda

        self.device = device
        self._pins = not fake_cuda.is_active()

    def new_stream(self) -> CopyStream:
        return torch.cuda.Stream(self.device)

    def new_event(self, timing: bool = False) -> CopyEvent:
        return torch.cuda.Event(enable_timing=timing)

    def current_stream(self) -> CopyStream:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: CopyStream) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(stream)

    def register(self, address: int, num_bytes: int) -> None:
        if not self._pins:
            return
        error = torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)
        code = int(getattr(error, "value", error))  # a pybind11 enum, 0 for cudaSuccess
        if code != 0:
            raise MemoryError(
                f"cudaHostRegister of {num_bytes / 2**30:.2f} GiB of host memory for the host "
                f"KV tier failed (CUDA error {code})"
            )

    def unregister(self, address: int) -> None:
        if self._pins:
            torch.cuda.cudart().cudaHostUnregister(address)


def copy_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` of the maximal runs where both ids go up by one: each
    is one copy."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


_Piece = tuple[str, list[BlockCopy], torch.Tensor]
"""Stores of one cache type gathered together: its name, the copies, their NPU ids on the
device."""


@dataclass(slots=True)
class _InFlight:
    """One plan's copies: landed when every event has completed."""

    plan: TransferPlan
    events: list[CopyEvent]
    stored: dict[str, set[int]] = field(default_factory=dict)  # host ids its stores write
    held: list[torch.Tensor] = field(default_factory=list)  # device memory its copies read
    timed: list[tuple[CopyEvent, CopyEvent]] = field(default_factory=list)  # (begin, end)

    def query(self) -> bool:
        return all(event.query() for event in self.events)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


class StreamCopier:
    """Issues one plan's stores and loads on side streams; reports plans in submission order."""

    def __init__(
        self,
        npu_caches: dict[str, torch.Tensor],
        host_caches: dict[str, torch.Tensor],
        runtime: CopyRuntime,
        staging_bytes: int = STORE_STAGING_BYTES,
    ) -> None:
        self.npu_caches = npu_caches
        self.host_caches = host_caches
        self.runtime = runtime
        self.store_stream = runtime.new_stream()
        self.load_stream = runtime.new_stream()
        self.staging = {
            name: torch.empty(
                (max(1, min(len(cache), staging_bytes // _block_bytes(cache))), *cache.shape[1:]),
                dtype=cache.dtype,
                device=cache.device,
            )
            for name, cache in npu_caches.items()
        }
        self._next = dict.fromkeys(npu_caches, 0)  # where each ring's next gather goes
        self._in_flight: deque[_InFlight] = deque()
        self.seconds = 0.0  # device time of the landed plans' copies, per stream

    @property
    def staging_bytes(self) -> int:
        return sum(_block_bytes(t) * len(t) for t in self.staging.values())

    def issue(self, plan: TransferPlan) -> None:
        """Issue ``plan``'s stores, then its loads; the compute stream waits for the gathers and
        the loads only."""
        compute = self.runtime.current_stream()
        flight = _InFlight(plan, [])
        self._in_flight.append(flight)  # before the loads: one may read this plan's stores
        if plan.stores:
            rounds = self._rounds(plan.stores)  # block ids copied to the device, on compute
            flight.held = [ids for pieces in rounds for _, _, ids in pieces]
            self.store_stream.wait_stream(compute)
            gathered, stored = self.runtime.new_event(), self.runtime.new_event(timing=True)
            with self.runtime.use(self.store_stream):
                flight.timed.append((self._begin(self.store_stream), stored))
                self._store(rounds, gathered)
                stored.record(self.store_stream)
            for name, copies in _by_cache_type(plan.stores):
                flight.stored[name] = {c.dst for c in copies}
            compute.wait_event(gathered)
            flight.events.append(stored)
        if plan.loads:
            self.load_stream.wait_stream(compute)  # after the gathers and the last forward
            for name, copies in _by_cache_type(plan.loads):
                for event in self._stores_into(name, {c.src for c in copies}):
                    self.load_stream.wait_event(event)
            loaded = self.runtime.new_event(timing=True)
            with self.runtime.use(self.load_stream):
                flight.timed.append((self._begin(self.load_stream), loaded))
                for name, copies in _by_cache_type(plan.loads):
                    self._load(name, copies)
                loaded.record(self.load_stream)
            compute.wait_event(loaded)
            flight.events.append(loaded)

    def poll(self, wait: bool = False) -> list[TransferPlan]:
        """Plans whose copies have all landed, in submission order (all of them if ``wait``)."""
        done = []
        while self._in_flight:
            flight = self._in_flight[0]
            if wait:
                flight.synchronize()
            elif not flight.query():
                break
            self._in_flight.popleft()
            self.seconds += sum(begin.elapsed_time(end) for begin, end in flight.timed) / 1e3
            done.append(flight.plan)
        return done

    def _begin(self, stream: CopyStream) -> CopyEvent:
        """A timing event recorded on ``stream`` now: where a plan's copies on it start."""
        event = self.runtime.new_event(timing=True)
        event.record(stream)
        return event

    def land_stores_into(self, cache_type: str, host_ids: set[int]) -> None:
        """Wait on the CPU for every store in flight into one of ``host_ids``."""
        for event in self._stores_into(cache_type, host_ids):
            event.synchronize()

    def _stores_into(self, cache_type: str, host_ids: set[int]) -> Iterator[CopyEvent]:
        for flight in self._in_flight:
            if not host_ids.isdisjoint(flight.stored.get(cache_type, ())):
                yield flight.events[0]  # a plan with stores records their event first

    def _rounds(self, stores: list[BlockCopy]) -> list[list[_Piece]]:
        """The stores in pieces of at most a staging ring, each with its NPU block ids on the
        device: every cache type's first piece in the first round, then one piece a round.

        The ids are copied on the compute stream, idle between steps (the engine waited for
        the last step's tokens): on a side stream a copy from pageable memory could wait for
        the bus copies of earlier stores still on it. ``_InFlight.held`` keeps them until the
        plan lands, so their memory is not reused before the gathers read it."""
        first_round, overflow = [], []
        for name, copies in _by_cache_type(stores):
            capacity, device = len(self.staging[name]), self.npu_caches[name].device
            for i in range(0, len(copies), capacity):
                piece = copies[i : i + capacity]
                ids = torch.tensor([c.src for c in piece], dtype=torch.long).to(device)
                if i:
                    overflow.append([(name, piece, ids)])
                else:
                    first_round.append((name, piece, ids))
        return [first_round, *overflow]

    def _store(self, rounds: list[list[_Piece]], gathered: CopyEvent) -> None:
        """Gather each round's NPU blocks into the staging rings, then copy them to their host
        blocks, one copy per run of consecutive host ids; ``gathered`` is recorded after the
        last gather. Every cache type's first ring-full is gathered before any bus copy, so the
        compute stream waits for bus copies only when a plan overflows a ring."""
        for index, pieces in enumerate(rounds):
            starts = [self._gather(name, ids) for name, _, ids in pieces]
            if index == len(rounds) - 1:
                gathered.record(self.store_stream)
            for (name, piece, _), start in zip(pieces, starts):
                ring, host = self.staging[name], self.host_caches[name]
                positions = list(range(start, start + len(piece)))
                for s, d, n in copy_runs(positions, [c.dst for c in piece]):
                    host[d : d + n].copy_(ring[s : s + n], non_blocking=True)

    def _gather(self, name: str, ids: torch.Tensor) -> int:
        """Gather NPU blocks ``ids`` into the next range of the ring; returns its start."""
        ring, npu, num_blocks = self.staging[name], self.npu_caches[name], len(ids)
        start = self._next[name] if self._next[name] + num_blocks <= len(ring) else 0
        self._next[name] = start + num_blocks
        torch.index_select(npu, 0, ids, out=ring[start : start + num_blocks])
        return start

    def _load(self, name: str, copies: list[BlockCopy]) -> None:
        npu, host = self.npu_caches[name], self.host_caches[name]
        for s, d, n in copy_runs([c.src for c in copies], [c.dst for c in copies]):
            npu[d : d + n].copy_(host[s : s + n], non_blocking=True)


def _block_bytes(cache: torch.Tensor) -> int:
    return cache[0].numel() * cache.element_size()


def _by_cache_type(copies: list[BlockCopy]) -> list[tuple[str, list[BlockCopy]]]:
    groups: dict[str, list[BlockCopy]] = {}
    for copy in copies:
        groups.setdefault(copy.cache_type, []).append(copy)
    return list(groups.items())
