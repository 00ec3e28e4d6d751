"""Which KV blocks each request uses, across the NPU tier and the optional host tier.

The manager decides; it holds no tensors. Each engine step it hands a ``TransferPlan`` (host
blocks to load into NPU blocks, NPU blocks to store into host blocks) to the transfer component,
which moves the bytes. The simulator drives this very class with no tensors at all.

Residency is derived from the two pools' hash maps, never kept in parallel flags::

    NPU only       h in the NPU map, not the host map    reusable now; lost on NPU eviction
    host only      h in the host map, not the NPU map    reload into a new NPU block first
    NPU and host   h in both maps                        reusable now; survives NPU eviction

Host retention policies (DESIGN section 4):
  * write-through promotion: a *hit* is a new request matching an NPU-resident block (the write
    that created the block is not one). When a block's hits reach ``write_through_threshold``
    and it has no host copy, it is stored to host. Threshold 0 stores every block when it is
    first written; ``None`` disables promotion.
  * write-back: when allocation evicts an NPU-only cached block, it is stored to host first.

Ordering: the transfer component runs a step's stores before its loads and both before that
step's forward pass, so a store always reads an evicted block before new KV overwrites it, and
a load lands before attention reads it. Host blocks are locked (ref count) while a transfer
involving them is in flight, so host eviction never takes them.
"""

from dataclasses import dataclass
from typing import NamedTuple

from replicas.block_pool import BlockPool
from replicas.hashing import BlockHash
from replicas.kv_events import KVEvent
from replicas.request import Request


class PrefixMatch(NamedTuple):
    """The longest cached prefix of a request, block by block. ``npu_block_ids[i]`` is the NPU
    block of matched block ``i``, or None when block ``i`` is host-only (``host_block_ids[i]``)."""

    npu_block_ids: list[int | None]
    host_block_ids: list[int | None]
    num_npu_blocks: int
    num_host_blocks: int

    @property
    def num_blocks(self) -> int:
        return len(self.npu_block_ids)


EMPTY_MATCH = PrefixMatch([], [], 0, 0)


class TransferPlan(NamedTuple):
    """Copies of one engine step. Stores run before loads."""

    stores: list[tuple[int, int]]  # (npu block id, host block id)
    loads: list[tuple[int, int]]  # (host block id, npu block id)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


@dataclass(slots=True)
class CacheStats:
    """Monotonic counters of one replica's prefix cache (tokens unless named blocks)."""

    queries: int = 0
    hits: int = 0
    npu_hits: int = 0
    host_hits: int = 0
    npu_evictions: int = 0
    host_evictions: int = 0
    write_through_promotions: int = 0
    write_backs: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_npu_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        write_through_threshold: int | None = 2,
        write_back: bool = False,
        record_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.npu = BlockPool(num_npu_blocks, "npu")
        self.host = BlockPool(num_host_blocks, "host") if num_host_blocks > 0 else None
        self.write_through_threshold = write_through_threshold if self.host else None
        self.write_back = write_back and self.host is not None
        self.record_events = record_events
        self._events: list[KVEvent] = []  # since the last drain, for routers' prefix indexes
        self.stats = CacheStats()
        self._req_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._stores: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []

    # ---- matching (no mutation) --------------------------------------------------------------
    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest run of leading full blocks cached in either tier. At least the last token of
        the request is always left to compute."""
        if not self.enable_prefix_caching:
            return EMPTY_MATCH
        max_blocks = (request.num_tokens - 1) // self.block_size
        npu_ids: list[int | None] = []
        host_ids: list[int | None] = []
        num_npu = num_host = 0
        for block_hash in request.block_hashes[:max_blocks]:
            npu_id = self.npu.lookup(block_hash)
            host_id = self.host.lookup(block_hash) if self.host else None
            if npu_id is None and host_id is None:
                break
            npu_ids.append(npu_id)
            host_ids.append(host_id)
            if npu_id is not None:
                num_npu += 1
            else:
                num_host += 1
        return PrefixMatch(npu_ids, host_ids, num_npu, num_host)

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> int:
        """Free NPU blocks that ``allocate_slots`` would consume (no mutation)."""
        held = self._req_blocks.get(request.request_id, ())
        num_tokens = request.num_computed_tokens + match.num_blocks * self.block_size
        num_total = -(-(num_tokens + num_new_tokens) // self.block_size)
        revived = sum(
            1 for b in match.npu_block_ids if b is not None and self.npu.blocks[b].ref_count == 0
        )
        return num_total - len(held) - match.num_npu_blocks + revived

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` tokens after its computed ones and, on
        its first allocation since admission or preemption, after the blocks of ``match``, which
        it adopts. Returns False, changing nothing, if the NPU tier lacks free blocks."""
        held = self._req_blocks.get(request.request_id)
        if held and match.num_blocks:
            raise ValueError(
                f"request {request.request_id} already holds blocks; cannot adopt a prefix match"
            )
        needed = self.num_blocks_needed(request, num_new_tokens, match)
        if needed > self.npu.num_free:
            return False
        blocks = self._req_blocks.setdefault(request.request_id, [])
        if match.num_blocks:
            self._adopt_match(request, blocks, match)
        num_tokens = request.num_computed_tokens + match.num_blocks * self.block_size
        num_missing = -(-(num_tokens + num_new_tokens) // self.block_size) - len(blocks)
        if num_missing > 0:
            blocks.extend(self._allocate_npu(num_missing))
        return True

    def _adopt_match(self, request: Request, blocks: list[int], match: PrefixMatch) -> None:
        # Protect every matched block in both tiers before any allocation can evict one.
        npu_hits = [b for b in match.npu_block_ids if b is not None]
        host_hits = [h for n, h in zip(match.npu_block_ids, match.host_block_ids) if n is None]
        self.npu.touch(npu_hits)
        if host_hits:
            self.host.touch(host_hits)  # locked until their loads land
        is_new_request = request.num_cached_tokens is None
        for npu_id in npu_hits:
            self._count_hit(npu_id, is_new_request)
        for i, npu_id in enumerate(match.npu_block_ids):
            if npu_id is None:
                (npu_id,) = self._allocate_npu(1)
                self.npu.cache(npu_id, request.block_hashes[i])
                self._loads.append((match.host_block_ids[i], npu_id))
                self._emit("stored", "npu", request.block_hashes[i])
            blocks.append(npu_id)
        self._num_cached_blocks[request.request_id] = match.num_blocks

    def _count_hit(self, npu_id: int, is_new_request: bool) -> None:
        if not is_new_request:
            return
        block = self.npu.blocks[npu_id]
        block.num_hits += 1
        threshold = self.write_through_threshold
        if threshold and block.num_hits >= threshold and not self._on_host(block.block_hash):
            if self._store(npu_id, block.block_hash):
                self.stats.write_through_promotions += 1

    def _allocate_npu(self, num_blocks: int) -> list[int]:
        block_ids, evicted = self.npu.allocate(num_blocks)
        for npu_id, block_hash in evicted:
            self.stats.npu_evictions += 1
            self._emit("removed", "npu", block_hash)
            if self.write_back and not self._on_host(block_hash):
                if self._store(npu_id, block_hash):
                    self.stats.write_backs += 1
        return block_ids

    def _on_host(self, block_hash: BlockHash) -> bool:
        return self.host is not None and self.host.lookup(block_hash) is not None

    def _store(self, npu_id: int, block_hash: BlockHash) -> bool:
        """Plan a copy of an NPU block to a new host block; False if every host block is locked."""
        if self.host.num_free == 0:
            return False
        (host_id,), evicted = self.host.allocate(1)  # locked until the store lands
        for _, old_hash in evicted:
            self.stats.host_evictions += 1
            self._emit("removed", "host", old_hash)
        self.host.cache(host_id, block_hash)
        self._stores.append((npu_id, host_id))
        self._emit("stored", "host", block_hash)
        return True

    # ---- after a forward pass ----------------------------------------------------------------
    def cache_blocks(self, request: Request) -> None:
        """Publish the request's newly full, computed blocks in the NPU hash map."""
        if not self.enable_prefix_caching:
            return
        blocks = self._req_blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            block_hash = request.block_hashes[i]
            if self.npu.cache(blocks[i], block_hash):
                self._emit("stored", "npu", block_hash)
                if self.write_through_threshold == 0 and not self._on_host(block_hash):
                    if self._store(blocks[i], block_hash):
                        self.stats.write_through_promotions += 1
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Release every block of the request, deepest first."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.npu.free(list(reversed(blocks)))

    def take_transfer_plan(self) -> TransferPlan:
        """The copies planned since the last call; the caller must run them, then call
        ``complete_transfer``."""
        plan = TransferPlan(self._stores, self._loads)
        self._stores, self._loads = [], []
        return plan

    def complete_transfer(self, plan: TransferPlan) -> None:
        """Unlock the host blocks of a transfer that has landed."""
        if not plan:
            return
        self.stats.blocks_stored += len(plan.stores)
        self.stats.blocks_loaded += len(plan.loads)
        self.host.free([host_id for _, host_id in plan.stores])
        self.host.free([host_id for host_id, _ in plan.loads])

    # ---- accounting --------------------------------------------------------------------------
    def record_admission(self, request: Request, match: PrefixMatch) -> None:
        """Count a request's first lookup: queries are its prompt tokens, hits the matched."""
        if request.num_cached_tokens is not None:
            return
        request.num_npu_cached_tokens = match.num_npu_blocks * self.block_size
        request.num_host_cached_tokens = match.num_host_blocks * self.block_size
        request.num_cached_tokens = request.num_npu_cached_tokens + request.num_host_cached_tokens
        self.stats.queries += request.num_prompt_tokens
        self.stats.hits += request.num_cached_tokens
        self.stats.npu_hits += request.num_npu_cached_tokens
        self.stats.host_hits += request.num_host_cached_tokens

    def block_ids(self, request_id: str) -> list[int]:
        return self._req_blocks.get(request_id, [])

    def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget unreferenced cached blocks of ``tier`` ("all", "npu" or "host")."""
        if tier not in ("all", "npu", "host"):
            raise ValueError(f"tier must be 'all', 'npu' or 'host', got {tier!r}")
        pools = {"npu": [self.npu], "host": [self.host], "all": [self.npu, self.host]}[tier]
        for pool in pools:
            if pool is not None:
                for _, block_hash in pool.evict_all_cached():
                    self._emit("removed", pool.name, block_hash)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _emit(self, kind: str, tier: str, block_hash: BlockHash) -> None:
        if self.record_events:
            self._events.append(KVEvent(kind, tier, block_hash))

    def check_integrity(self) -> None:
        self.npu.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        held: dict[int, int] = {}
        for blocks in self._req_blocks.values():
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        for block in self.npu.blocks:
            assert block.ref_count == held.get(block.block_id, 0), (
                f"npu block {block.block_id} ref_count {block.ref_count} but held "
                f"{held.get(block.block_id, 0)} times"
            )
