"""Copies KV blocks between the NPU tier and the host tier, as the cache manager planned them.

The KV tensors are block-major, so a block is one contiguous run of every layer's K and V. One
step's plan becomes, per cache type and direction, one batched copy:

  * on CPU, one fused ``_foreach_copy_`` of every block straight from source to destination
    (a gather into a staging tensor and a scatter out of it would move every byte twice); the
    copies run synchronously;
  * on CUDA (``replicas.kv.stream_copier.StreamCopier``), direct copies between the pinned
    host slab and the device blocks, one per contiguous run, on side streams: a step waits for
    the loads it reads and the stores' device-side gather, never for a store's bus copy.

With backing tiers (``backing``: per tier behind host, disk among them, a
``replicas.kv.tiers.BackingStore`` per cache type), a plan's backing stores run first: each
host block is copied out (so that this plan's stores may overwrite it; a store still in flight
into it lands first) and handed to its tier's store, which writes it on a thread of its own.
Its backing loads are handed to the stores after the plan's copies, reading straight into
their (locked, on CUDA pinned) host blocks, from which a later load copies them to the device;
``poll_backing`` reports the reads that ended.

A ``runtime`` (``replicas.kv.stream_copier.CopyRuntime``) given with CPU tensors runs the CUDA
algorithm on them, so that tests check its ordering and bookkeeping without a GPU.
"""

import functools
import inspect
import logging
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replicas.kv.host_memory import HostSlab, allocate_host_tensor
from replicas.kv.records import BackingCopy, BlockCopy, TransferPlan
from replicas.kv.stream_copier import (
    STORE_STAGING_BYTES,
    CopyRuntime,
    StreamCopier,
    TorchCudaRuntime,
)

if TYPE_CHECKING:
    from replicas.kv.tiers import BackingStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferStats:
    blocks_loaded: int = 0
    blocks_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    seconds: float = 0.0


class KVTransfer:
    """Owns the host KV tensors of one replica; the only component that copies between tiers."""

    def __init__(
        self,
        npu_caches: dict[str, torch.Tensor],
        num_host_blocks: dict[str, int],
        *,
        runtime: CopyRuntime | None = None,
        staging_bytes: int = STORE_STAGING_BYTES,
        backing: "dict[str, dict[str, BackingStore]] | None" = None,
    ) -> None:
        """``backing``: per backing tier, its store per cache type."""
        self.npu_caches = npu_caches
        self.backing = backing or {}
        self._reads: list[tuple[list[BackingCopy], Future[list[bool]]]] = []
        self.device = next(iter(npu_caches.values())).device
        self.is_cuda = self.device.type == "cuda"
        if runtime is None and self.is_cuda:
            runtime = TorchCudaRuntime(self.device)
        self.block_bytes = {
            cache_type: cache[0].numel() * cache.element_size()
            for cache_type, cache in npu_caches.items()
        }
        self.stats = TransferStats()
        self._slab: HostSlab | None = None
        self._copier: StreamCopier | None = None
        self._landed: deque[TransferPlan] = deque()  # CPU plans, landed when submitted
        shapes = {
            c: ((num_host_blocks[c], *cache.shape[1:]), cache.dtype)
            for c, cache in npu_caches.items()
        }
        if runtime is not None:
            self._slab = HostSlab(shapes, runtime)
            self.host_caches = self._slab.tensors
            self._copier = StreamCopier(npu_caches, self.host_caches, runtime, staging_bytes)
            logger.info(
                "kv transfer: direct copies on side streams, %.1f MiB of device staging",
                self._copier.staging_bytes / 2**20,
            )
        else:
            self.host_caches = {
                c: allocate_host_tensor(shape, dtype, pin=False)
                for c, (shape, dtype) in shapes.items()
            }
            # Per-block views, built once: a CPU transfer copies every block straight from its
            # source to its destination in one fused call (no staging pass, no fresh memory).
            self._npu_blocks = {c: t.unbind(0) for c, t in npu_caches.items()}
            self._host_blocks = {c: t.unbind(0) for c, t in self.host_caches.items()}

    @property
    def streamed(self) -> bool:
        """Whether copies run on side streams (CUDA, or a test's runtime) rather than at once."""
        return self._copier is not None

    @property
    def host_bytes(self) -> int:
        """Host memory of the host pools: the pinned slab's exact size when streamed."""
        if self._slab is not None:
            return self._slab.nbytes
        return sum(t.numel() * t.element_size() for t in self.host_caches.values())

    @property
    def staging_bytes(self) -> int:
        """Device memory of the stores' staging rings (0 on CPU)."""
        return self._copier.staging_bytes if self._copier is not None else 0

    def submit(self, plan: TransferPlan) -> None:
        """Issue the plan's copies; loads land before the next forward pass on this device."""
        if not plan:
            return
        start = time.perf_counter()
        self._store_to_backing(plan.backing_stores)
        if self._copier is not None:
            self._copier.issue(plan)  # reported after the plans in flight before it
        else:
            self._run_cpu(plan)
            self._landed.append(plan)
        for tier, cache_type, store in self._stores():
            loads = _of(plan.backing_loads, tier, cache_type)
            if loads:
                host = self.host_caches[cache_type]
                outs = [host[c.host_id] for c in loads]
                future = store.load_many([c.block_hash for c in loads], outs)
                self._reads.append((loads, future))
        self.stats.seconds += time.perf_counter() - start  # issuing; on CUDA poll adds the copies
        self.stats.blocks_stored += len(plan.stores)
        self.stats.blocks_loaded += len(plan.loads)
        self.stats.bytes_stored += sum(self.block_bytes[c.cache_type] for c in plan.stores)
        self.stats.bytes_loaded += sum(self.block_bytes[c.cache_type] for c in plan.loads)

    def poll(self, wait: bool = False) -> list[TransferPlan]:
        """Plans whose copies have all landed, in submission order (all of them if ``wait``)."""
        if self._copier is not None:
            before = self._copier.seconds
            done = self._copier.poll(wait)
            self.stats.seconds += self._copier.seconds - before  # the copies' device time
            return done
        done = list(self._landed)
        self._landed.clear()
        return done

    def close(self) -> list[TransferPlan]:
        """Land every copy in flight (returned, for the cache manager) and unpin the host slab;
        the transfer copies nothing after."""
        done = self.poll(wait=True)
        if self._slab is not None:
            self._slab.release()
        return done

    # ---- backing tiers -----------------------------------------------------------------------
    def _stores(self) -> "list[tuple[str, str, BackingStore]]":
        """(tier, cache type, store) of every backing store."""
        return [(t, c, store) for t, stores in self.backing.items() for c, store in stores.items()]

    def _store_to_backing(self, copies: tuple[BackingCopy, ...]) -> None:
        """Hand copies of host blocks to the backing stores (a host block's own store from NPU
        lands first)."""
        for tier, cache_type, store in self._stores() if copies else ():
            selected = _of(copies, tier, cache_type)
            if not selected:
                continue
            host = self.host_caches[cache_type]
            if self._copier is not None:
                self._copier.land_stores_into(cache_type, {c.host_id for c in selected})
            takes = _takes(type(store))
            for copy in selected:
                block = host[copy.host_id].clone()
                extra = {"batch": True} if copy.batch and "batch" in takes else {}
                if copy.tenant and "tenant" in takes:
                    extra["tenant"] = copy.tenant
                store.store(copy.block_hash, block, copy.retained_until, copy.weight, **extra)

    def poll_backing(self, timeout: float | None = 0.0) -> list[tuple[BackingCopy, bool]]:
        """Backing reads that ended, with whether each filled its host block; waits up to
        ``timeout`` seconds (None: no bound) for all of them to end. The waiting thread holds
        no GIL meanwhile, so the reads run at full speed."""
        if not self._reads:
            return []
        futures = [f for _, f in self._reads]
        if timeout is None or timeout > 0:
            wait(futures, timeout=timeout)
        done = [(c, f) for c, f in self._reads if f.done()]
        self._reads = [(c, f) for c, f in self._reads if not f.done()]
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


def _succeeded(future: "Future[list[bool]]", num_reads: int) -> list[bool]:
    try:
        return [bool(ok) for ok in future.result()]
    except Exception:  # reads that raised are misses
        logger.exception("backing tier read failed")
        return [False] * num_reads


def _copy_blocks(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source block into its destination block in one fused call."""
    torch._foreach_copy_(destinations, sources)


def _of_cache_type(copies: list[BlockCopy], cache_type: str) -> list[BlockCopy]:
    return [c for c in copies if c.cache_type == cache_type]


def _of(copies: tuple[BackingCopy, ...], tier: str, cache_type: str) -> list[BackingCopy]:
    return [c for c in copies if c.tier == tier and c.cache_type == cache_type]


@functools.cache
def _takes(store_type: type) -> set[str]:
    """Which of ``batch`` and ``tenant`` a backing store's ``store`` takes (a plugin's written
    before them may not)."""
    return {"batch", "tenant"} & set(inspect.signature(store_type.store).parameters)
