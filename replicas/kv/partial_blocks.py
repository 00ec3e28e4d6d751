"""Reuse of a prefix's last, partial block: the computed tokens of a freed block that was not full.

Prefix caching publishes whole blocks only, so a prompt that extends another by a few tokens
(a 12-token chunk after a long shared prefix, the next turn of a chat) would recompute the
tokens of the earlier prompt's last block, up to ``block_size - 1`` of them. When a request
frees its blocks, its last block, if partly computed, is remembered here under what names the
tokens before it (``Request.parent_key``: the hash of the block before, which names the whole prefix
since hashes chain and carry the cache salt) with the token ids it holds. The block stays free
(it holds no hash) but is *kept* (``BlockPool.free(keep=...)``): allocation takes it after
every empty block and before evicting any cached block, so it lives on spare capacity only,
until it serves a copy: then it ages in the LRU queue as a cached block does. (Queued as cached
from the start, one kept block per finished request, most never reused, evicted whole blocks:
the simulator's acceptance trace lost 0.007 of hit rate.)

A later request whose tokens after that prefix begin with some of those ids reuses them: the KV
of a token depends only on the tokens up to it, which are the same. It gets a block of its own
and a planned copy of the source block into it (``TransferPlan.block_copies``, run before the
next forward), and counts the reused tokens as computed (NPU cached tokens). The source is not
consumed, so any number of different continuations of one fixed prefix each reuse it. An entry
is valid while its block's ``generation`` (allocations so far) is unchanged: allocation may
overwrite the block; a source is held (a reference) from the allocation that plans its copy
until the plan is taken, so nothing allocated in the same step overwrites it before the copy.

    blocks:  | b0 full | b1 full | b2: t32..t43 computed, rest empty |   request A frees
    entry:   hash(b1) -> (b2, generation g, (t32, ..., t43))
    request B = t0..t43 + new tokens: matches b0, b1 (whole blocks) and 12 tokens of b2; it
    gets b5, b2 is copied into b5, and B computes from t44 on, writing into b5 only.

NPU tier only, dense models only (a sliding-window cache type would need its partial blocks at
once), and not when the caller limits the match (prompt logprobs, whose scores come by block).
"""

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from replicas.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from replicas.engine.request import Request


class PartialBlock(NamedTuple):
    """A freed block holding the computed KV of ``token_ids``, valid while its generation is
    ``generation``."""

    block_id: int
    generation: int
    token_ids: tuple[int, ...]


class PartialBlocks:
    """Freed partial blocks of one NPU pool by ``parent_key``, at most one per key (the latest)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._entries: OrderedDict[bytes, PartialBlock] = OrderedDict()
        self._held: list[int] = []  # sources of planned copies, held until the plan is taken

    def __len__(self) -> int:
        return len(self._entries)

    def tail_of(
        self, request: "Request", blocks: list[int | None]
    ) -> tuple[bytes, int, list[int]] | None:
        """(its parent key, block id, token ids) of a request's partly computed last block
        (``blocks``: its block table), to ``remember`` once freed; None when there is none."""
        num_full, num_in_tail = divmod(request.num_computed_tokens, self.block_size)
        if not num_in_tail or num_full >= len(blocks) or blocks[num_full] is None:
            return None
        if num_full > len(request.block_hashes):
            return None
        start = num_full * self.block_size
        token_ids = request.all_token_ids[start : start + num_in_tail]
        parent = request.parent_key(num_full)
        return parent, blocks[num_full], token_ids

    def remember(self, parent: bytes, block_id: int, token_ids: Sequence[int]) -> None:
        """A block just freed that holds the computed KV of ``token_ids`` after ``parent``."""
        block = self.pool.blocks[block_id]
        if block.ref_count or block.block_hash is not None or not token_ids:
            return  # still held, or cached: not a reusable partial block
        if parent in self._entries:
            self._drop(self._entries.pop(parent))  # the latest continuation replaces it
        self._entries[parent] = PartialBlock(block_id, block.generation, tuple(token_ids))
        while len(self._entries) > self.pool.num_blocks:
            self._drop(self._entries.popitem(last=False)[1])

    def find(self, parent: bytes, token_ids: Sequence[int]) -> tuple[PartialBlock, int] | None:
        """The valid partial block after ``parent`` and how many of its tokens begin
        ``token_ids`` (at least one), or None. Stale entries are dropped."""
        entry = self._entries.get(parent)
        if entry is None:
            return None
        if not self.is_valid(entry):
            del self._entries[parent]
            return None
        num_same = 0
        for held, wanted in zip(entry.token_ids, token_ids):
            if held != wanted:
                break
            num_same += 1
        return (entry, num_same) if num_same else None

    def is_valid(self, entry: PartialBlock) -> bool:
        """Whether the block still holds the entry's KV: not allocated since, nor cached, and
        free unless it is held as a source."""
        block = self.pool.blocks[entry.block_id]
        if block.generation != entry.generation or block.block_hash is not None:
            return False
        return block.ref_count == 0 or entry.block_id in self._held

    def hold(self, entry: PartialBlock) -> None:
        """Take a reference on a source until ``release_held``: a copy from it is planned."""
        self.pool.touch([entry.block_id])
        self._held.append(entry.block_id)

    @property
    def held(self) -> list[int]:
        """The sources held, once per planned copy."""
        return list(self._held)

    def release_held(self) -> None:
        """Drop the references of ``hold`` (the plan with the copies was taken); a source that
        served a copy goes to the back of the ordinary queue, aging as a cached block does."""
        if not self._held:
            return
        held, self._held = self._held, []
        self.pool.free(held, keep=set(held), keep_at_back=True)

    def forget(self) -> None:
        """Drop every entry; their blocks are empty blocks again."""
        for entry in self._entries.values():
            self._drop(entry)
        self._entries.clear()

    def _drop(self, entry: PartialBlock) -> None:
        if self.is_valid(entry) and entry.block_id not in self._held:
            self.pool.discard_contents(entry.block_id)
