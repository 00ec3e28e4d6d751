"""Copies KV blocks between the NPU tier and the host tier, as the cache manager planned them.

The KV tensors are block-major, so a block is one contiguous run of every layer's K and V. One
step's plan becomes, per cache group and direction, one batched copy:

  * on CPU, one fused ``_foreach_copy_`` of every block straight from source to destination
    (a gather into a staging tensor and a scatter out of it would move every byte twice);
  * on CUDA, one gather into a staging tensor on the device side and one copy across the bus::

        store  npu[npu_ids] --gather--> staging --D2H--> pinned --scatter--> host[host_ids]
        load   host[host_ids] --gather--> pinned --H2D--> staging --scatter--> npu[npu_ids]

On CPU the copies run synchronously. On CUDA they run on a side stream with pinned host memory:

  * the side stream first waits for the compute stream, so a store reads KV the last forward
    pass finished writing;
  * stores are issued before loads on the same stream, so a block evicted and reused in one
    step is read before it is overwritten;
  * the compute stream waits for the step's event before its forward pass, so attention never
    reads a block whose load has not landed;
  * a store's host scatter runs once its event has completed; until then its host blocks stay
    locked by the cache manager (``poll`` reports completed plans).
"""

import logging
import time
from dataclasses import dataclass, field

import torch

from replicas.host_memory import allocate_host_tensor
from replicas.kv_cache_types import BlockCopy, TransferPlan

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferStats:
    blocks_loaded: int = 0
    blocks_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Pending:
    plan: TransferPlan
    event: "torch.cuda.Event | None"
    store_staging: dict[str, torch.Tensor] = field(default_factory=dict)
    keep_alive: list[torch.Tensor] = field(default_factory=list)


class KVTransfer:
    """Owns the host KV tensors of one replica; the only component that copies between tiers."""

    def __init__(
        self, npu_caches: dict[str, torch.Tensor], num_host_blocks: dict[str, int]
    ) -> None:
        self.npu_caches = npu_caches
        self.device = next(iter(npu_caches.values())).device
        self.is_cuda = self.device.type == "cuda"
        self.host_caches = {
            group: allocate_host_tensor(
                (num_host_blocks[group], *cache.shape[1:]), cache.dtype, pin=self.is_cuda
            )
            for group, cache in npu_caches.items()
        }
        self.block_bytes = {
            group: cache[0].numel() * cache.element_size() for group, cache in npu_caches.items()
        }
        # Per-block views, built once: a CPU transfer copies every block straight from its
        # source to its destination in one fused call (no staging pass, no fresh memory).
        self._npu_blocks = {g: t.unbind(0) for g, t in npu_caches.items()}
        self._host_blocks = {g: t.unbind(0) for g, t in self.host_caches.items()}
        self.stats = TransferStats()
        self._pending: list[_Pending] = []
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_caches.values())

    def submit(self, plan: TransferPlan) -> None:
        """Issue the plan's copies; loads land before the next forward pass on this device."""
        if not plan:
            return
        start = time.perf_counter()
        if self.is_cuda:
            self._submit_cuda(plan)
        else:
            self._run_cpu(plan)
            self._pending.append(_Pending(plan, None))
        self.stats.seconds += time.perf_counter() - start
        self.stats.blocks_stored += len(plan.stores)
        self.stats.blocks_loaded += len(plan.loads)
        self.stats.bytes_stored += sum(self.block_bytes[c.group] for c in plan.stores)
        self.stats.bytes_loaded += sum(self.block_bytes[c.group] for c in plan.loads)

    def poll(self, wait: bool = False) -> list[TransferPlan]:
        """Plans whose copies have all landed (all of them if ``wait``)."""
        done: list[TransferPlan] = []
        still: list[_Pending] = []
        for pending in self._pending:
            if pending.event is not None and not wait and not pending.event.query():
                still.append(pending)
                continue
            if pending.event is not None:
                pending.event.synchronize()
                self._scatter_stores(pending)
            done.append(pending.plan)
        self._pending = still
        return done

    # ---- CPU -----------------------------------------------------------------------------
    def _run_cpu(self, plan: TransferPlan) -> None:
        for group, npu in self._npu_blocks.items():
            host = self._host_blocks[group]
            stores = _of_group(plan.stores, group)
            if stores:
                _copy_blocks([host[c.dst] for c in stores], [npu[c.src] for c in stores])
            loads = _of_group(plan.loads, group)
            if loads:
                _copy_blocks([npu[c.dst] for c in loads], [host[c.src] for c in loads])

    # ---- CUDA ----------------------------------------------------------------------------
    def _submit_cuda(self, plan: TransferPlan) -> None:
        pending = _Pending(plan, torch.cuda.Event())
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for group, npu in self.npu_caches.items():
                stores = _of_group(plan.stores, group)
                if stores:
                    gathered = npu.index_select(0, _ids(stores, "src", self.device))
                    staging = torch.empty(gathered.shape, dtype=npu.dtype, pin_memory=True)
                    staging.copy_(gathered, non_blocking=True)
                    pending.store_staging[group] = staging
            self._pending.append(pending)
            if plan.loads:
                loading = {(c.group, c.src) for c in plan.loads}
                if any(
                    loading.intersection((c.group, c.dst) for c in p.plan.stores)
                    for p in self._pending
                    if p.store_staging
                ):
                    # A load reads a host block whose store is still in flight: land it first.
                    self._stream.synchronize()
                    for earlier in self._pending:
                        self._scatter_stores(earlier)
            for group, npu in self.npu_caches.items():
                loads = _of_group(plan.loads, group)
                if not loads:
                    continue
                host = self.host_caches[group]
                staging = torch.empty(
                    (len(loads), *host.shape[1:]), dtype=host.dtype, pin_memory=True
                )
                torch.index_select(host, 0, _ids(loads, "src", torch.device("cpu")), out=staging)
                npu.index_copy_(
                    0, _ids(loads, "dst", self.device), staging.to(self.device, non_blocking=True)
                )
                pending.keep_alive.append(staging)
            pending.event.record(self._stream)
        compute.wait_event(pending.event)

    def _scatter_stores(self, pending: _Pending) -> None:
        """Copy a landed store's staging buffers into the host pool (CPU work)."""
        for group, staging in pending.store_staging.items():
            host_ids = _ids(_of_group(pending.plan.stores, group), "dst", torch.device("cpu"))
            self.host_caches[group].index_copy_(0, host_ids, staging)
        pending.store_staging.clear()


def _copy_blocks(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source block into its destination block in one fused call."""
    torch._foreach_copy_(destinations, sources)


def _of_group(copies: list[BlockCopy], group: str) -> list[BlockCopy]:
    return [c for c in copies if c.group == group]


def _ids(copies: list[BlockCopy], field: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([getattr(c, field) for c in copies], dtype=torch.long, device=device)
