"""The peer tier: blocks another replica of the deployment holds in its NPU or host tier, pulled
through Ray instead of computed again.

The router names a *source* for a request when another replica holds a longer prefix of its
prompt than the replica it chose and pulling the difference costs less than computing it
(``CacheHints.peer``). The serving replica offers the source's blocks to this tier
(``PeerStore.offer``), so that onboarding finds them past its own match as it finds disk
blocks, and reads them into host blocks: one call per source and batch
(``ReplicaActor.export_blocks``, the blocks' bytes carried by Ray's object store as numpy
arrays), on the store's own thread. The tier is only read; nothing is written to it and it
announces nothing (the blocks are the source's, which announces them itself)::

    router          the chosen replica lacks blocks k..n that replica s holds -> source s
    serving replica offer(hashes[:n], s); onboard: blocks k..n-1 -> host, read from s
    source s        export_blocks: each block by hash, from NPU or host, with its checksum

A block is accepted only when the source's fingerprint (model weights, architecture, KV format,
block size) equals this replica's, its hash is the one asked for (hashes cover the
``cache_salt``) and its checksum matches its bytes; a source that died, refused or answered
after ``timeout_s`` costs a recompute of those blocks, never an error or a wrong token.
"""

import math
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
from pydantic import Field

from replicas.cache_hints import PeerSource
from replicas.kv.events import TierTraits
from replicas.kv.hashing import BlockHash
from replicas.kv.records import TierUsage
from replicas.kv.tiers.base import BackingStore
from replicas.kv.tiers.pull_fit import PullFit
from replicas.kv.tiers.registry import BackingOptions, TierContext, TierPlugin

OFFER_TTL_S = 30.0
"""How long a source's offer stands: past it, the source may have evicted the blocks."""
DEFAULT_READ_S_PER_BYTE = 1 / 1e9
"""What a pull is assumed to cost per byte before one was measured (1 GB/s), with no fixed
part."""


class PeerOptions(BackingOptions):
    timeout_s: float = Field(
        2.0, gt=0, description="Longest wait for a source's answer; past it, recompute."
    )


class PeerBlock(NamedTuple):
    """One exported block: its hash, the crc32 of its bytes and its bytes (uint8, on the CPU).
    A numpy array, not a tensor: Ray's object store hands a reader a numpy array without
    copying it (a tensor is pickled), so a pull costs one copy, into the host block."""

    block_hash: BlockHash
    checksum: int
    data: np.ndarray


PROBE_SIZES = (1, 16)
"""Blocks per timed probe pull (``PeerStore.probe``): each size timed ``PROBE_REPEATS`` times,
its quickest counted, after one pull of a block that is not (the first call between two
replicas also sets up their connection)."""
PROBE_REPEATS = 3


class PeerStats(NamedTuple):
    blocks_pulled: int
    pull_failures: int  # blocks asked for and not accepted (refused, missing, late, corrupt)
    bytes_pulled: int
    seconds: float
    round_trip_s: float = 0.0  # a pull's part whatever its size (PullFit), probes included
    timed_pulls: int = 0  # the calls to sources the fit has seen, probes included


def block_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A CPU block's bytes (a view where the block is contiguous), whatever its dtype."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()


def checksum(data: np.ndarray) -> int:
    """crc32 of a block's bytes."""
    return zlib.crc32(data)


def export(fingerprint: str, blocks: list[torch.Tensor | None], hashes: list[BlockHash]):
    """What a source answers: each found block with its hash, checksum and bytes
    (``PeerBlock``), None for a block it no longer holds; ``fingerprint`` travels with them."""
    exported = [None if t is None else block_bytes(t) for t in blocks]
    return fingerprint, [
        None if d is None else PeerBlock(h, checksum(d), d) for h, d in zip(hashes, exported)
    ]


def probe_answer(engine: Any, cache_type: str, num_blocks: int) -> tuple:
    """What a source answers a probe (``PeerStore.probe``): ``num_blocks`` blocks of zeros of
    its ``cache_type`` block's shape and dtype, checksummed and sent as an export's."""
    block = engine.runner.kv_caches[cache_type][0]
    hashes = [b"probe" + i.to_bytes(11, "little") for i in range(num_blocks)]
    zeros = [torch.zeros(block.shape, dtype=block.dtype) for _ in hashes]
    return export(engine.fingerprint, zeros, hashes)


class LocalPeer:
    """An in-process source: an ``Engine`` of this process (tests, a process holding several
    engines); an actor handle is the other kind."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def export_blocks(self, cache_type: str, hashes: list[BlockHash]):
        return self.engine.export_blocks(cache_type, hashes)

    def export_probe(self, cache_type: str, num_blocks: int):
        return probe_answer(self.engine, cache_type, num_blocks)


def _ask(handle: Any, method: str, args: tuple, timeout_s: float):
    """The source's answer to ``method(*args)`` (``export_blocks`` or ``export_probe``),
    waiting up to ``timeout_s``."""
    if isinstance(handle, LocalPeer):
        return getattr(handle, method)(*args)
    import ray

    return ray.get(getattr(handle, method).remote(*args), timeout=timeout_s)


class PeerStore:
    """The peer tier of one cache type: the blocks sources offer, read on a thread of its own.
    The engine thread calls every method but the reads."""

    def __init__(
        self, cache_type: str, fingerprint: str, timeout_s: float, block_bytes: int
    ) -> None:
        self.cache_type = cache_type
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.block_bytes = block_bytes
        # hash -> (source, offered at), oldest offer first
        self._offers: OrderedDict[BlockHash, tuple[PeerSource, float]] = OrderedDict()
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"kv-peer-{cache_type}")
        self._lock = threading.Lock()  # the counters, shared with the reading thread
        self._pulled = self._failures = self._bytes = 0
        self._seconds = 0.0
        self._fit = PullFit(0.0, DEFAULT_READ_S_PER_BYTE * block_bytes)  # per call to a source

    def offer(self, hashes: list[BlockHash], source: PeerSource) -> None:
        """``source`` holds these blocks (the router's word): reads may ask it for them."""
        now = time.monotonic()
        for block_hash in hashes:
            self._offers[block_hash] = (source, now)
            self._offers.move_to_end(block_hash)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._offers

    def load_many(self, block_hashes: list[BlockHash], outs: list[torch.Tensor]) -> Future:
        by_source: dict[int, list[int]] = {}
        sources = {}
        for i, block_hash in enumerate(block_hashes):
            offer = self._offers.get(block_hash)
            if offer is None:  # withdrawn since it was planned: a miss
                continue
            by_source.setdefault(offer[0].replica_index, []).append(i)
            sources[offer[0].replica_index] = offer[0]
        return self._io.submit(self._read, block_hashes, outs, by_source, sources)

    def _read(self, hashes, outs, by_source, sources) -> list[bool]:
        ok = [False] * len(hashes)
        start = time.perf_counter()
        for index, positions in by_source.items():
            asked = [hashes[i] for i in positions]
            began = time.perf_counter()
            try:
                answer = _ask(
                    sources[index].handle, "export_blocks", (self.cache_type, asked), self.timeout_s
                )
            except Exception:  # a dead, failed or late source: those blocks are recomputed
                continue
            fingerprint, blocks = answer
            if fingerprint != self.fingerprint:
                continue  # another model, KV format or block size: refused
            for i, block in zip(positions, blocks):
                ok[i] = self._accept(block, hashes[i], outs[i])
            with self._lock:
                self._fit.add(len(asked), time.perf_counter() - began)
        with self._lock:
            self._pulled += sum(ok)
            self._failures += len(ok) - sum(ok)
            self._bytes += sum(o.numel() * o.element_size() for o, good in zip(outs, ok) if good)
            self._seconds += time.perf_counter() - start
        return ok

    @staticmethod
    def _accept(block: PeerBlock | None, block_hash: BlockHash, out: torch.Tensor) -> bool:
        """Copy a valid block into its host block: the hash asked for, its checksum, its
        size; anything else is a miss. (The source's fingerprint, already checked, covers
        the KV format and block size: the same size means the same shape and dtype.)"""
        if block is None or block.block_hash != block_hash:
            return False
        data = block.data
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            return False
        if data.nbytes != out.numel() * out.element_size() or checksum(data) != block.checksum:
            return False
        if out.is_contiguous():
            np.copyto(out.view(-1).view(torch.uint8).numpy(), data.reshape(-1))
        else:
            out.copy_(torch.from_numpy(data.copy()).view(out.dtype).view(out.shape))
        return True

    def probe(self, handle: Any, sizes: tuple[int, ...] = PROBE_SIZES) -> bool:
        """Time pulls of ``sizes`` blocks of zeros from the replica ``handle`` (its
        ``export_probe``), the quickest of ``PROBE_REPEATS`` per size, into the fit as pulls:
        so that this replica prices its first real pull with a measured round trip and rate.
        False, and nothing counted, if the source failed, was late or answered for another
        model or KV format."""
        times: dict[int, list[float]] = {}
        for i, num_blocks in enumerate((1, *[n for n in sizes for _ in range(PROBE_REPEATS)])):
            began = time.perf_counter()
            try:
                args = (self.cache_type, num_blocks)
                fingerprint, blocks = _ask(handle, "export_probe", args, self.timeout_s)
            except Exception:
                return False
            seconds = time.perf_counter() - began
            if fingerprint != self.fingerprint or len(blocks) != num_blocks:
                return False
            for block in blocks:
                if block.data.nbytes != self.block_bytes or checksum(block.data) != block.checksum:
                    return False
            if i:  # the first one set up the connection
                times.setdefault(num_blocks, []).append(seconds)
        with self._lock:
            for num_blocks, seconds in times.items():
                self._fit.add(num_blocks, min(seconds))
        return True

    def discard(self, block_hash: BlockHash) -> None:
        self._offers.pop(block_hash, None)

    def read_seconds_per_block(self) -> float:
        """A pull's time per block, its fixed part apart (``PullFit``; 1 GB/s before the first
        pull)."""
        with self._lock:
            return self._fit.parts()[1]

    def read_seconds_fixed(self) -> float:
        """A pull's time whatever its size: one call to a source (0 before the first pull)."""
        with self._lock:
            return self._fit.parts()[0]

    def retain(self, block_hash: BlockHash, until: float) -> bool:
        return False

    def expire(self) -> None:
        """Forget offers older than ``OFFER_TTL_S``."""
        oldest = time.monotonic() - OFFER_TTL_S
        while self._offers and next(iter(self._offers.values()))[1] < oldest:
            self._offers.popitem(last=False)

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, 0)

    def cached_hashes(self) -> list[BlockHash]:
        return []  # the source's blocks, which it announces itself

    def reset(self) -> list[BlockHash]:
        self._offers.clear()
        return []

    def track_changes(self) -> None:
        pass

    def drain_changes(self) -> list[tuple[bool, BlockHash]]:
        return []

    def store(self, block_hash, block, retained_until, weight, batch=False) -> None:
        raise RuntimeError("the peer tier is only read")

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def stats(self) -> PeerStats:
        with self._lock:
            fit = self._fit
            fixed = fit.parts()[0]
            return PeerStats(
                self._pulled, self._failures, self._bytes, self._seconds, fixed, fit.num_pulls
            )


def open_stores(context: TierContext, options: PeerOptions) -> dict[str, BackingStore]:
    """One peer store per cache type."""
    stores = {}
    for cache_type in context.num_blocks:
        shape, dtype = context.block_shapes[cache_type], context.dtypes[cache_type]
        block_bytes = math.prod(shape) * dtype.itemsize
        stores[cache_type] = PeerStore(
            cache_type, context.fingerprint, options.timeout_s, block_bytes
        )
    return stores


PLUGIN = TierPlugin(TierTraits("peer", hit_weight=0.5), PeerOptions, open_stores, writable=False)
