"""Which KV blocks each request uses, per cache type, across the NPU tier and the host tier.

The manager decides; it holds no tensors. Each engine step it hands a ``TransferPlan`` (host
blocks to load into NPU blocks, NPU blocks to store into host blocks) to the transfer component,
which moves the bytes. The simulator drives this very class with no tensors at all.

Cache types (groups): a dense model has one, ``full``; a hybrid model adds ``sliding`` for its
sliding-window layers. Each group has its own NPU and host pools and hash maps over the same
block hashes. Residency is derived from those maps, never kept in parallel flags::

    NPU only       h in the NPU map, not the host map    reusable now; lost on NPU eviction
    host only      h in the host map, not the NPU map    reload into a new NPU block first
    NPU and host   h in both maps                        reusable now; survives NPU eviction

Safe prefix (hybrid): ``L`` leading blocks are reusable only if global KV exists (either tier)
for all ``L`` and sliding KV exists (either tier) for the window ending at the match point::

    block:      0   1   2   3   4   5   6   7 | 8 ...      (L = 8, window spans blocks 6..7)
    full:       *   *   *   *   *   *   *   * |
    sliding:    -   -   -   -   -   -   *   * |            ("-" need not exist)

Sliding blocks that leave a running request's window are released at once (they stay cached).

Host retention policies (DESIGN section 4), per group:
  * write-through promotion: a *hit* is a new request matching an NPU-resident block (the write
    that created the block is not one). When a block's hits reach ``write_through_threshold``
    and it has no host copy, it is stored to host. Threshold 0 stores every block when it is
    first written; ``None`` disables promotion.
  * write-back: when allocation evicts an NPU-only cached block, it is stored to host first.

Ordering: the transfer component runs a plan's stores before its loads and both before the
next forward pass, so a store reads an evicted block before new KV overwrites it and a load
lands before attention reads it. Host blocks are locked (ref count) while a transfer involving
them is in flight, so host eviction never takes them.
"""

from dataclasses import dataclass, field

from replicas.block_pool import BlockPool
from replicas.hashing import BlockHash
from replicas.kv_cache_types import (
    EMPTY_MATCH,
    BlockCopy,
    CacheGroupSpec,
    CacheStats,
    GroupMatch,
    PrefixMatch,
    TransferPlan,
)
from replicas.kv_events import KVEvent
from replicas.request import Request

__all__ = ["EMPTY_MATCH", "CacheStats", "KVCacheManager", "PrefixMatch", "TransferPlan"]


@dataclass(slots=True)
class _Group:
    spec: CacheGroupSpec
    npu: BlockPool
    host: BlockPool | None
    blocks: dict[str, list[int | None]] = field(default_factory=dict)  # None: released
    num_cached: dict[str, int] = field(default_factory=dict)  # leading blocks hashed

    @property
    def name(self) -> str:
        return self.spec.name

    def on_host(self, block_hash: BlockHash) -> bool:
        return self.host is not None and self.host.lookup(block_hash) is not None


class KVCacheManager:
    def __init__(
        self,
        num_npu_blocks: int = 0,
        block_size: int = 16,
        *,
        groups: list[CacheGroupSpec] | None = None,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        write_through_threshold: int | None = 2,
        write_back: bool = False,
        record_events: bool = False,
    ) -> None:
        specs = groups or [CacheGroupSpec("full", num_npu_blocks, num_host_blocks)]
        if specs[0].sliding_window is not None:
            raise ValueError("the first cache group must be global attention")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = [
            _Group(
                spec,
                BlockPool(spec.num_npu_blocks, f"npu[{spec.name}]"),
                BlockPool(spec.num_host_blocks, f"host[{spec.name}]")
                if spec.num_host_blocks > 0
                else None,
            )
            for spec in specs
        ]
        has_host = all(g.host is not None for g in self.groups)
        if any(g.host is not None for g in self.groups) and not has_host:
            raise ValueError("every cache group needs host blocks when the host tier is on")
        self.write_through_threshold = write_through_threshold if has_host else None
        self.write_back = write_back and has_host
        self.record_events = record_events
        self.stats = CacheStats()
        self._events: list[KVEvent] = []  # since the last drain, for routers' prefix indexes
        self._stores: list[BlockCopy] = []
        self._loads: list[BlockCopy] = []

    @property
    def npu(self) -> BlockPool:
        """The primary (global-attention) group's NPU pool."""
        return self.groups[0].npu

    @property
    def host(self) -> BlockPool | None:
        return self.groups[0].host

    # ---- matching (no mutation) --------------------------------------------------------------
    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest safe cached prefix, in whole blocks; at least the request's last token is
        always left to compute."""
        if not self.enable_prefix_caching:
            return EMPTY_MATCH
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        primary = self.groups[0]
        length = 0
        for block_hash in hashes:
            if primary.npu.lookup(block_hash) is None and not primary.on_host(block_hash):
                break
            length += 1
        for group in self.groups[1:]:
            length = self._safe_length(group, hashes, length)
        matches = {}
        for group in self.groups:
            first = group.spec.window_start(length * self.block_size, self.block_size)
            npu_ids = [group.npu.lookup(h) for h in hashes[first:length]]
            host_ids = [group.host.lookup(h) if group.host else None for h in hashes[first:length]]
            matches[group.name] = GroupMatch(first, npu_ids, host_ids)
        num_npu = sum(1 for b in matches[primary.name].npu_block_ids if b is not None)
        return PrefixMatch(length, num_npu, length - num_npu, matches)

    def _safe_length(self, group: _Group, hashes: list[BlockHash], limit: int) -> int:
        """Longest ``L <= limit`` whose window of ``group`` blocks is cached in either tier."""
        present = [group.npu.lookup(h) is not None or group.on_host(h) for h in hashes[:limit]]
        last_missing = -1
        best = 0
        for length in range(limit + 1):
            first = group.spec.window_start(length * self.block_size, self.block_size)
            if last_missing < first:
                best = length
            if length < limit and not present[length]:
                last_missing = length
        return best

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> dict[str, int]:
        """Free NPU blocks per group that ``allocate_slots`` would consume (no mutation)."""
        num_tokens = request.num_computed_tokens + match.num_blocks * self.block_size
        total = -(-(num_tokens + num_new_tokens) // self.block_size)
        needed = {}
        for group in self.groups:
            held = len(group.blocks.get(request.request_id, ()))
            part = match.groups.get(group.name)
            adopted = revived = 0
            if part is not None:
                held = part.first_block  # released placeholders before the window
                adopted = sum(1 for b in part.npu_block_ids if b is not None)
                revived = sum(
                    1
                    for b in part.npu_block_ids
                    if b is not None and group.npu.blocks[b].ref_count == 0
                )
            needed[group.name] = total - held - adopted + revived
        return needed

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, match: PrefixMatch = EMPTY_MATCH
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` tokens after its computed ones and, on
        its first allocation since admission or preemption, after the blocks of ``match``, which
        it adopts. Returns False, changing nothing, if any group lacks free NPU blocks."""
        if match.num_blocks and any(request.request_id in g.blocks for g in self.groups):
            raise ValueError(
                f"request {request.request_id} already holds blocks; cannot adopt a prefix match"
            )
        needed = self.num_blocks_needed(request, num_new_tokens, match)
        if any(needed[g.name] > g.npu.num_free for g in self.groups):
            return False
        num_tokens = request.num_computed_tokens + match.num_blocks * self.block_size
        num_total = -(-(num_tokens + num_new_tokens) // self.block_size)
        for group in self.groups:
            blocks = group.blocks.setdefault(request.request_id, [])
            if match.num_blocks:
                self._adopt(group, request, blocks, match.groups[group.name], match.num_blocks)
            if num_total > len(blocks):
                blocks.extend(self._allocate_npu(group, num_total - len(blocks)))
        return True

    def _adopt(
        self,
        group: _Group,
        request: Request,
        blocks: list[int | None],
        part: GroupMatch,
        num_blocks: int,
    ) -> None:
        # Protect every matched block in both tiers before any allocation can evict one.
        npu_hits = [b for b in part.npu_block_ids if b is not None]
        host_hits = [h for n, h in zip(part.npu_block_ids, part.host_block_ids) if n is None]
        group.npu.touch(npu_hits)
        if host_hits:
            group.host.touch(host_hits)  # locked until their loads land
        if request.num_cached_tokens is None:  # a new request, not a resumed one
            for npu_id in npu_hits:
                self._count_hit(group, npu_id)
        blocks.extend([None] * part.first_block)
        for offset, npu_id in enumerate(part.npu_block_ids):
            if npu_id is None:
                block_hash = request.block_hashes[part.first_block + offset]
                (npu_id,) = self._allocate_npu(group, 1)
                group.npu.cache(npu_id, block_hash)
                self._loads.append(BlockCopy(part.host_block_ids[offset], npu_id, group.name))
                self._emit(group, "stored", "npu", block_hash)
            blocks.append(npu_id)
        group.num_cached[request.request_id] = num_blocks

    def _count_hit(self, group: _Group, npu_id: int) -> None:
        block = group.npu.blocks[npu_id]
        block.num_hits += 1
        threshold = self.write_through_threshold
        if threshold and block.num_hits >= threshold and not group.on_host(block.block_hash):
            if self._store(group, npu_id, block.block_hash):
                self.stats.count(group.name, "write_through_promotions")

    def _allocate_npu(self, group: _Group, num_blocks: int) -> list[int]:
        block_ids, evicted = group.npu.allocate(num_blocks)
        for npu_id, block_hash in evicted:
            self.stats.count(group.name, "npu_evictions")
            self._emit(group, "removed", "npu", block_hash)
            if self.write_back and not group.on_host(block_hash):
                if self._store(group, npu_id, block_hash):
                    self.stats.count(group.name, "write_backs")
        return block_ids

    def _store(self, group: _Group, npu_id: int, block_hash: BlockHash) -> bool:
        """Plan a copy of an NPU block to a new host block; False if every host block is locked."""
        if group.host.num_free == 0:
            return False
        (host_id,), evicted = group.host.allocate(1)  # locked until the store lands
        for _, old_hash in evicted:
            self.stats.count(group.name, "host_evictions")
            self._emit(group, "removed", "host", old_hash)
        group.host.cache(host_id, block_hash)
        self._stores.append(BlockCopy(npu_id, host_id, group.name))
        self._emit(group, "stored", "host", block_hash)
        return True

    # ---- after a forward pass ----------------------------------------------------------------
    def cache_blocks(self, request: Request) -> None:
        """Publish the request's newly full, computed blocks in each group's NPU hash map, then
        release sliding blocks that left the window."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for group in self.groups:
            blocks = group.blocks[request.request_id]
            start = group.num_cached.get(request.request_id, 0)
            for i in range(start, num_full) if self.enable_prefix_caching else ():
                if blocks[i] is None:
                    continue
                block_hash = request.block_hashes[i]
                if group.npu.cache(blocks[i], block_hash):
                    self._emit(group, "stored", "npu", block_hash)
                    immediate = self.write_through_threshold == 0
                    if immediate and not group.on_host(block_hash):
                        if self._store(group, blocks[i], block_hash):
                            self.stats.count(group.name, "write_through_promotions")
            group.num_cached[request.request_id] = max(start, num_full)
            if group.spec.sliding_window is not None:
                self._release_out_of_window(group, request, blocks)

    def _release_out_of_window(
        self, group: _Group, request: Request, blocks: list[int | None]
    ) -> None:
        first_needed = group.spec.window_start(request.num_computed_tokens, self.block_size)
        stale = [i for i in range(min(first_needed, len(blocks))) if blocks[i] is not None]
        if stale:
            group.npu.free([blocks[i] for i in reversed(stale)])
            for i in stale:
                blocks[i] = None
            self.stats.count(group.name, "blocks_freed_out_of_window", len(stale))

    def free(self, request: Request) -> None:
        """Release every block of the request in every group, deepest first."""
        for group in self.groups:
            blocks = group.blocks.pop(request.request_id, [])
            group.num_cached.pop(request.request_id, None)
            group.npu.free([b for b in reversed(blocks) if b is not None])

    def take_transfer_plan(self) -> TransferPlan:
        """The copies planned since the last call; the caller must run them, then call
        ``complete_transfer``."""
        plan = TransferPlan(self._stores, self._loads)
        self._stores, self._loads = [], []
        return plan

    def complete_transfer(self, plan: TransferPlan) -> None:
        """Unlock the host blocks of a transfer that has landed."""
        by_name = {g.name: g for g in self.groups}
        for copy in plan.stores:
            self.stats.count(copy.group, "blocks_stored")
            by_name[copy.group].host.free([copy.dst])
        for copy in plan.loads:
            self.stats.count(copy.group, "blocks_loaded")
            by_name[copy.group].host.free([copy.src])

    # ---- accounting --------------------------------------------------------------------------
    def record_admission(self, request: Request, match: PrefixMatch) -> None:
        """Count a request's first lookup: queries are its prompt tokens, hits the matched."""
        if request.num_cached_tokens is not None:
            return
        request.num_npu_cached_tokens = match.num_npu_blocks * self.block_size
        request.num_host_cached_tokens = match.num_host_blocks * self.block_size
        request.num_cached_tokens = request.num_npu_cached_tokens + request.num_host_cached_tokens
        for name, part in match.groups.items():
            num_npu = sum(1 for b in part.npu_block_ids if b is not None)
            num_host = len(part.npu_block_ids) - num_npu
            request.cached_tokens_by_cache_type[name] = (
                num_npu * self.block_size,
                num_host * self.block_size,
            )
        self.stats.queries += request.num_prompt_tokens
        self.stats.hits += request.num_cached_tokens
        self.stats.npu_hits += request.num_npu_cached_tokens
        self.stats.host_hits += request.num_host_cached_tokens

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in the primary group."""
        return self.groups[0].blocks.get(request_id, [])

    def block_tables(self, request_id: str) -> dict[str, list[int | None]]:
        """The request's blocks per group (None where a sliding block was released)."""
        return {g.name: g.blocks.get(request_id, []) for g in self.groups}

    def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget unreferenced cached blocks of ``tier`` ("all", "npu" or "host")."""
        if tier not in ("all", "npu", "host"):
            raise ValueError(f"tier must be 'all', 'npu' or 'host', got {tier!r}")
        for group in self.groups:
            pools = {"npu": [group.npu], "host": [group.host], "all": [group.npu, group.host]}
            for pool, tier_name in zip(pools[tier], ["npu", "host"] if tier == "all" else [tier]):
                if pool is not None:
                    for _, block_hash in pool.evict_all_cached():
                        self._emit(group, "removed", tier_name, block_hash)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _emit(self, group: _Group, kind: str, tier: str, block_hash: BlockHash) -> None:
        # The router indexes global KV, the bound on any reuse; sliding KV is not published.
        if self.record_events and group is self.groups[0]:
            self._events.append(KVEvent(kind, tier, block_hash))

    def check_integrity(self) -> None:
        for group in self.groups:
            group.npu.check_integrity()
            if group.host is not None:
                group.host.check_integrity()
            held: dict[int, int] = {}
            for blocks in group.blocks.values():
                for b in blocks:
                    if b is not None:
                        held[b] = held.get(b, 0) + 1
            for block in group.npu.blocks:
                assert block.ref_count == held.get(block.block_id, 0), (
                    f"{group.npu.name} block {block.block_id} ref_count {block.ref_count} but "
                    f"held {held.get(block.block_id, 0)} times"
                )
