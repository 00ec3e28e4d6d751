"""Copies KV blocks between the NPU tier and the host tier, as the cache manager planned them.

The KV tensors are block-major, so a block is one contiguous run of every layer's K and V. One
step's plan becomes, per cache type and direction, one batched copy:

  * on CPU, one fused ``_foreach_copy_`` of every block straight from source to destination
    (a gather into a staging tensor and a scatter out of it would move every byte twice);
  * on CUDA, one gather on the device side and one copy across the bus, through pinned
    staging blocks that are allocated once, at start-up (``_StagingRing``)::

        store  npu[npu_ids] --gather--> device tmp --D2H--> staging --scatter--> host[host_ids]
        load   host[host_ids] --gather--> staging --H2D--> device tmp --scatter--> npu[npu_ids]

No transfer allocates pinned memory: block ids that the device reads travel through the
staging ring's pinned id slots too. A copy larger than the ring is split into pieces of half
the ring, so that the host side of one piece overlaps the bus copy of the one before.

On CPU the copies run synchronously. On CUDA they run on a side stream:

  * the side stream first waits for the compute stream, so a store reads KV the last forward
    pass finished writing;
  * stores are issued before loads on the same stream, so a block evicted and reused in one
    step is read before it is overwritten;
  * the compute stream waits for the step's last event before its forward pass, so attention
    never reads a block whose load has not landed;
  * a store's host scatter runs once its event has completed; until then its host blocks stay
    locked by the cache manager (``poll`` reports completed plans, in submission order);
  * a load that reads a host block whose store has not landed yet lands that store first, and
    staging blocks are reused only after the copy that used them last has landed.

With a disk tier (``disk``: a ``replicas.kv.disk.DiskStore`` per cache type), a plan's disk
stores run first: each host block is copied out (so that this plan's stores may overwrite it)
and handed to the store's IO thread. Its disk loads are handed to that thread after the plan's
copies, reading straight into their (locked) host blocks; ``poll_disk`` reports the reads that
ended.

``staged=True`` runs the CUDA algorithm on CPU tensors (unpinned, with copies that land at
once), so that its bookkeeping is tested on machines without a GPU.
"""

import contextlib
import logging
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replicas.kv.host_memory import allocate_host_tensor
from replicas.kv.records import BlockCopy, DiskCopy, TransferPlan

if TYPE_CHECKING:
    from replicas.kv.disk import DiskStore

logger = logging.getLogger(__name__)

STAGING_BYTES = 64 * 2**20
"""Pinned staging memory per cache type and direction (stores, loads) on CUDA."""


@dataclass(slots=True)
class TransferStats:
    blocks_loaded: int = 0
    blocks_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    seconds: float = 0.0


class _Landed:
    """Stands in for a CUDA event where copies are done when issued."""

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _StagingRing:
    """Staging blocks of one cache type and direction, allocated once and handed out in
    submission order; a range is taken again only after the copy that held it has landed."""

    def __init__(
        self, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool
    ) -> None:
        self.capacity = capacity
        self.blocks = allocate_host_tensor((capacity, *block_shape), dtype, pin=pin)
        self.ids = torch.zeros(capacity, dtype=torch.long, pin_memory=pin)
        self.next = 0  # where the next range starts, unless it must wrap to 0

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size() + self.ids.numel() * 8

    def candidate(self, num_blocks: int) -> int:
        return self.next if self.next + num_blocks <= self.capacity else 0


@dataclass(slots=True)
class _Piece:
    """One range of one staging ring, held by an issued copy until it lands."""

    ring: _StagingRing
    start: int
    num_blocks: int
    cache_type: str
    store_dst: torch.Tensor | None = None  # host block ids of a store, scattered on landing

    def overlaps(self, ring: _StagingRing, start: int, num_blocks: int) -> bool:
        return (
            self.ring is ring
            and start < self.start + self.num_blocks
            and self.start < start + num_blocks
        )


@dataclass(slots=True)
class _Pending:
    """Copies issued together; ``plan`` is set on the last piece of a plan only."""

    plan: TransferPlan | None
    event: "torch.cuda.Event | _Landed"
    piece: _Piece | None = None
    landed: bool = False


class KVTransfer:
    """Owns the host KV tensors of one replica; the only component that copies between tiers."""

    def __init__(
        self,
        npu_caches: dict[str, torch.Tensor],
        num_host_blocks: dict[str, int],
        *,
        staged: bool | None = None,
        staging_bytes: int = STAGING_BYTES,
        disk: "dict[str, DiskStore] | None" = None,
    ) -> None:
        self.npu_caches = npu_caches
        self.disk = disk or {}
        self._disk_reads: list[tuple[list[DiskCopy], Future[list[bool]]]] = []
        self.device = next(iter(npu_caches.values())).device
        self.is_cuda = self.device.type == "cuda"
        self.staged = self.is_cuda if staged is None else staged
        if self.is_cuda and not self.staged:
            raise ValueError("KV transfers on CUDA always go through the staging ring")
        self.host_caches = {
            cache_type: allocate_host_tensor(
                (num_host_blocks[cache_type], *cache.shape[1:]), cache.dtype, pin=self.is_cuda
            )
            for cache_type, cache in npu_caches.items()
        }
        self.block_bytes = {
            cache_type: cache[0].numel() * cache.element_size()
            for cache_type, cache in npu_caches.items()
        }
        self.stats = TransferStats()
        self._pending: deque[_Pending] = deque()
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._new_event = torch.cuda.Event if self.is_cuda else _Landed
        if self.staged:
            self._store_rings, self._load_rings = (
                {
                    cache_type: _StagingRing(
                        max(1, min(len(cache), staging_bytes // self.block_bytes[cache_type])),
                        tuple(cache.shape[1:]),
                        cache.dtype,
                        pin=self.is_cuda,
                    )
                    for cache_type, cache in npu_caches.items()
                }
                for _ in range(2)
            )
            logger.info(
                "kv transfer: %.1f MiB of %sstaging blocks (%s per direction)",
                self.staging_bytes / 2**20,
                "pinned " if self.is_cuda else "",
                ", ".join(f"{c}: {r.capacity}" for c, r in self._store_rings.items()),
            )
        else:
            # Per-block views, built once: a CPU transfer copies every block straight from its
            # source to its destination in one fused call (no staging pass, no fresh memory).
            self._npu_blocks = {c: t.unbind(0) for c, t in npu_caches.items()}
            self._host_blocks = {c: t.unbind(0) for c, t in self.host_caches.items()}

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_caches.values())

    @property
    def staging_bytes(self) -> int:
        """Host memory of the staging rings (0 without them)."""
        if not self.staged:
            return 0
        rings = [*self._store_rings.values(), *self._load_rings.values()]
        return sum(ring.nbytes for ring in rings)

    def staging_tensors(self) -> list[torch.Tensor]:
        """Every staging tensor (blocks and ids), allocated once at start-up."""
        if not self.staged:
            return []
        rings = [*self._store_rings.values(), *self._load_rings.values()]
        return [t for ring in rings for t in (ring.blocks, ring.ids)]

    def submit(self, plan: TransferPlan) -> None:
        """Issue the plan's copies; loads land before the next forward pass on this device."""
        if not plan:
            return
        start = time.perf_counter()
        self._store_to_disk(plan.disk_stores)
        if self.staged and (plan.stores or plan.loads):
            self._submit_staged(plan)
        else:
            self._run_cpu(plan)
            self._pending.append(_Pending(plan, _Landed(), landed=True))
        for cache_type, store in self.disk.items():
            loads = _of_cache_type(plan.disk_loads, cache_type)
            if loads:
                host = self.host_caches[cache_type]
                outs = [host[c.host_id] for c in loads]
                future = store.load_many([c.block_hash for c in loads], outs)
                self._disk_reads.append((loads, future))
        self.stats.seconds += time.perf_counter() - start
        self.stats.blocks_stored += len(plan.stores)
        self.stats.blocks_loaded += len(plan.loads)
        self.stats.bytes_stored += sum(self.block_bytes[c.cache_type] for c in plan.stores)
        self.stats.bytes_loaded += sum(self.block_bytes[c.cache_type] for c in plan.loads)

    def poll(self, wait: bool = False) -> list[TransferPlan]:
        """Plans whose copies have all landed, in submission order (all of them if ``wait``)."""
        done: list[TransferPlan] = []
        while self._pending:
            pending = self._pending[0]
            if not (wait or pending.landed or pending.event.query()):
                break  # later copies on the same stream cannot have landed before this one
            self._land(pending)
            self._pending.popleft()
            if pending.plan is not None:
                done.append(pending.plan)
        return done

    # ---- disk --------------------------------------------------------------------------------
    def _store_to_disk(self, copies: tuple[DiskCopy, ...]) -> None:
        """Hand copies of host blocks to the disk stores (a host block's own store lands first)."""
        for cache_type, store in self.disk.items():
            selected = _of_cache_type(copies, cache_type)
            if not selected:
                continue
            host = self.host_caches[cache_type]
            if self.staged:
                self._land_stores_into(cache_type, torch.tensor([c.host_id for c in selected]))
            for copy in selected:
                block = host[copy.host_id].clone()
                store.store(copy.block_hash, block, copy.retained_until, copy.weight)

    def poll_disk(self, timeout: float | None = 0.0) -> list[tuple[DiskCopy, bool]]:
        """Disk reads that ended, with whether each filled its host block; waits up to
        ``timeout`` seconds (None: no bound) for all of them to end. The waiting thread holds
        no GIL meanwhile, so the reads run at full speed."""
        if not self._disk_reads:
            return []
        futures = [f for _, f in self._disk_reads]
        if timeout is None or timeout > 0:
            wait(futures, timeout=timeout)
        done = [(c, f) for c, f in self._disk_reads if f.done()]
        self._disk_reads = [(c, f) for c, f in self._disk_reads if not f.done()]
        results = []
        for copies, future in done:
            results.extend(zip(copies, _succeeded(future, len(copies))))
        return results

    # ---- CPU -----------------------------------------------------------------------------
    def _run_cpu(self, plan: TransferPlan) -> None:
        if not (plan.stores or plan.loads):
            return
        for cache_type, npu in self._npu_blocks.items():
            host = self._host_blocks[cache_type]
            stores = _of_cache_type(plan.stores, cache_type)
            if stores:
                _copy_blocks([host[c.dst] for c in stores], [npu[c.src] for c in stores])
            loads = _of_cache_type(plan.loads, cache_type)
            if loads:
                _copy_blocks([npu[c.dst] for c in loads], [host[c.src] for c in loads])

    # ---- staged (CUDA) -------------------------------------------------------------------
    def _submit_staged(self, plan: TransferPlan) -> None:
        pieces: list[tuple[str, str, list[BlockCopy]]] = []
        for kind, copies, rings in (
            ("store", plan.stores, self._store_rings),
            ("load", plan.loads, self._load_rings),
        ):
            for cache_type in self.npu_caches:
                selected = _of_cache_type(copies, cache_type)
                if not selected:
                    continue
                capacity = rings[cache_type].capacity
                size = len(selected) if len(selected) <= capacity else max(1, capacity // 2)
                for i in range(0, len(selected), size):
                    pieces.append((kind, cache_type, selected[i : i + size]))
        compute = torch.cuda.current_stream(self.device) if self.is_cuda else None
        if self._stream is not None:
            self._stream.wait_stream(compute)
        stream_context = (
            torch.cuda.stream(self._stream)
            if self._stream is not None
            else contextlib.nullcontext()
        )
        with stream_context:
            for index, (kind, cache_type, copies) in enumerate(pieces):
                is_last = index == len(pieces) - 1
                pending = _Pending(plan if is_last else None, self._new_event())
                if kind == "store":
                    pending.piece = self._issue_store(cache_type, copies)
                else:
                    pending.piece = self._issue_load(cache_type, copies)
                pending.event.record(self._stream)
                self._pending.append(pending)
        if compute is not None:
            compute.wait_event(self._pending[-1].event)

    def _issue_store(self, cache_type: str, copies: list[BlockCopy]) -> _Piece:
        piece = self._reserve(self._store_rings[cache_type], len(copies), cache_type)
        staging, ids = self._slots(piece)
        ids.copy_(_ids(copies, "src"))
        npu = self.npu_caches[cache_type]
        gathered = npu.index_select(0, ids.to(self.device, non_blocking=True))
        staging.copy_(gathered, non_blocking=True)
        piece.store_dst = _ids(copies, "dst")
        return piece

    def _issue_load(self, cache_type: str, copies: list[BlockCopy]) -> _Piece:
        sources = _ids(copies, "src")
        self._land_stores_into(cache_type, sources)
        piece = self._reserve(self._load_rings[cache_type], len(copies), cache_type)
        staging, ids = self._slots(piece)
        torch.index_select(self.host_caches[cache_type], 0, sources, out=staging)
        ids.copy_(_ids(copies, "dst"))
        self.npu_caches[cache_type].index_copy_(
            0,
            ids.to(self.device, non_blocking=True),
            staging.to(self.device, non_blocking=True),
        )
        return piece

    def _reserve(self, ring: _StagingRing, num_blocks: int, cache_type: str) -> _Piece:
        """A range of ``ring`` that no copy in flight uses, landing the oldest ones if needed."""
        start = ring.candidate(num_blocks)
        while True:
            holder = next(
                (
                    i
                    for i, p in enumerate(self._pending)
                    if not p.landed
                    and p.piece is not None
                    and p.piece.overlaps(ring, start, num_blocks)
                ),
                None,
            )
            if holder is None:
                break
            self._land_through(holder)
        ring.next = start + num_blocks
        return _Piece(ring, start, num_blocks, cache_type)

    def _land_stores_into(self, cache_type: str, host_ids: torch.Tensor) -> None:
        """Land every store still in flight into one of ``host_ids`` (and all before it): a load
        gathers from the host pool on the CPU, so it must see the stored bytes."""
        wanted = set(host_ids.tolist())
        last = None
        for i, pending in enumerate(self._pending):
            piece = pending.piece
            if pending.landed or piece is None or piece.store_dst is None:
                continue
            if piece.cache_type == cache_type and not wanted.isdisjoint(piece.store_dst.tolist()):
                last = i
        if last is not None:
            self._land_through(last)

    def _land_through(self, index: int) -> None:
        for i, pending in enumerate(self._pending):
            if i > index:
                break
            self._land(pending)

    def _land(self, pending: _Pending) -> None:
        """Wait for a piece's copies; scatter a store's staging blocks into the host pool."""
        if pending.landed:
            return
        pending.event.synchronize()
        piece = pending.piece
        if piece is not None and piece.store_dst is not None:
            staging, _ = self._slots(piece)
            self.host_caches[piece.cache_type].index_copy_(0, piece.store_dst, staging)
        pending.landed = True

    @staticmethod
    def _slots(piece: _Piece) -> tuple[torch.Tensor, torch.Tensor]:
        end = piece.start + piece.num_blocks
        return piece.ring.blocks[piece.start : end], piece.ring.ids[piece.start : end]


def _succeeded(future: "Future[list[bool]]", num_reads: int) -> list[bool]:
    try:
        return [bool(ok) for ok in future.result()]
    except Exception:  # reads that raised are misses
        logger.exception("disk read failed")
        return [False] * num_reads


def _copy_blocks(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source block into its destination block in one fused call."""
    torch._foreach_copy_(destinations, sources)


def _of_cache_type(
    copies: "list[BlockCopy] | tuple[DiskCopy, ...]", cache_type: str
) -> "list[BlockCopy] | list[DiskCopy]":
    return [c for c in copies if c.cache_type == cache_type]


def _ids(copies: list[BlockCopy], field: str) -> torch.Tensor:
    """Block ids of ``copies`` as a CPU tensor."""
    return torch.tensor([getattr(c, field) for c in copies], dtype=torch.long)
